"""Device detection: what kind of machine a kernel would run on.

:class:`DeviceSpec` is the frozen description of one device (CPU, CUDA GPU, MPS, ...) that kernel
constraints are checked against: device type, name, CUDA compute capability ("SM"), the
:class:`GPUGeneration` it belongs to, the tensor-core generation, bf16/fp8 support, memory, and the
versions of the driver, CUDA runtime, cuDNN and torch that a measured timing depends on (the PerfDB
fingerprint). ``DeviceSpec.detect()`` builds it once per device and memoizes it.

SM -> generation table (NVIDIA compute capability, see the CUDA C Programming Guide, "Compute
Capabilities")::

    SM            GPUGeneration   tensor_core_gen   bf16   fp8    examples
    < 7.5         UNKNOWN         0                 no     no     P100 (6.0), V100 (7.0)
    7.5           TURING          2                 no     no     T4, RTX 20xx
    8.0 8.6 8.7   AMPERE          3                 yes    no     A100, A10, RTX 30xx, Orin
    8.9           ADA_LOVELACE    4 (fp8 cores)     yes    yes    L4, L40, RTX 40xx
    9.x           HOPPER          4                 yes    yes    H100, H200, GH200
    >= 10.0       BLACKWELL       5                 yes    yes    B200 (10.0), GB300 (10.3), RTX 50xx (12.0)

Future SMs (11.x, 12.x and above) map to BLACKWELL, the newest generation this module knows, so a
new GPU gets the newest known constraints rather than none; kernels that need a precise SM range
carry it as data on their ``KernelSpec``. Volta (7.0, tensor-core gen 1) and older are UNKNOWN:
no LayerZero GPU kernel targets them.

Only the memo of ``detect()`` is process-global state (an ``lru_cache``); :meth:`DeviceSpec.clear_cache`
empties it (tests, or after ``CUDA_VISIBLE_DEVICES`` changes in a fresh process).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from layerzero.core.errors import ConfigurationError, InvalidInputError, expected_got

logger = logging.getLogger("layerzero.core.device")

__all__ = [
    "DeviceSpec",
    "device_free_bytes",
    "GPUGeneration",
    "gpu_generation_from_sm",
    "tensor_core_generation",
]


class GPUGeneration(IntEnum):
    """NVIDIA GPU architecture generations LayerZero knows, ordered oldest to newest.

    Compare with ``>=`` to express "this generation or newer" (``gen >= GPUGeneration.AMPERE``).
    ``UNKNOWN`` (0) is any non-NVIDIA device, a CPU, or an NVIDIA GPU older than Turing.
    """

    UNKNOWN = 0
    TURING = 1
    AMPERE = 2
    ADA_LOVELACE = 3
    HOPPER = 4
    BLACKWELL = 5


# Tensor-core generation per GPU generation (NVIDIA naming: Volta 1st, Turing 2nd, Ampere 3rd,
# Ada / Hopper 4th (fp8), Blackwell 5th). 0 means "no tensor cores LayerZero can use".
_TENSOR_CORE_GEN: dict[GPUGeneration, int] = {
    GPUGeneration.UNKNOWN: 0,
    GPUGeneration.TURING: 2,
    GPUGeneration.AMPERE: 3,
    GPUGeneration.ADA_LOVELACE: 4,
    GPUGeneration.HOPPER: 4,
    GPUGeneration.BLACKWELL: 5,
}


def gpu_generation_from_sm(major: int, minor: int) -> GPUGeneration:
    """Map a CUDA compute capability ``major.minor`` to its :class:`GPUGeneration`.

    7.5 -> TURING; 8.0/8.6/8.7 (any 8.x but 8.9) -> AMPERE; 8.9 -> ADA_LOVELACE; 9.x -> HOPPER;
    10.0 and above (including 11.x, 12.x and future SMs) -> BLACKWELL, the newest known; below 7.5
    -> UNKNOWN. See the module docstring for the full table.

    Args:
        major: compute-capability major version (int >= 0), e.g. 9 for H100.
        minor: compute-capability minor version (int >= 0), e.g. 0 for H100.

    Raises:
        InvalidInputError: ``major`` or ``minor`` is not a non-negative int.

    >>> gpu_generation_from_sm(8, 9).name
    'ADA_LOVELACE'
    """
    for label, value in (("major", major), ("minor", minor)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInputError(
                expected_got(
                    f"gpu_generation_from_sm: SM {label}",
                    "a non-negative int",
                    repr(value),
                    "Pass torch.cuda.get_device_capability()'s (major, minor).",
                )
            )
    if major >= 10:
        return GPUGeneration.BLACKWELL
    if major == 9:
        return GPUGeneration.HOPPER
    if major == 8:
        return GPUGeneration.ADA_LOVELACE if minor == 9 else GPUGeneration.AMPERE
    if major == 7 and minor >= 5:
        return GPUGeneration.TURING
    return GPUGeneration.UNKNOWN


def tensor_core_generation(generation: GPUGeneration) -> int:
    """Tensor-core generation of a :class:`GPUGeneration`: TURING 2, AMPERE 3, ADA_LOVELACE 4 (fp8),
    HOPPER 4, BLACKWELL 5, UNKNOWN 0 (none usable)."""
    return _TENSOR_CORE_GEN[GPUGeneration(generation)]


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Frozen description of one device, the hardware half of a selection context.

    Fields:
        device_type: torch device type: ``"cpu"``, ``"cuda"`` (also ROCm/HIP builds), ``"mps"``, ...
        index: device ordinal (``cuda:1`` -> 1), ``None`` for the CPU.
        name: marketing name (``"NVIDIA H100 80GB HBM3"``) or CPU model name; the type when unknown.
        sm: CUDA compute capability ``(major, minor)``; ``None`` off NVIDIA (CPU, MPS, ROCm).
        generation: :class:`GPUGeneration` from ``sm`` (``UNKNOWN`` when ``sm`` is ``None``).
        tensor_core_gen: see :func:`tensor_core_generation`; 0 when none.
        supports_bf16: bfloat16 arithmetic is usable: SM >= 8.0 on NVIDIA; ``torch.cuda.is_bf16_supported()``
            on ROCm; always True on CPU (torch implements bf16 everywhere; native speed needs
            ``"avx512_bf16"``/``"amx_bf16"`` in ``cpu_isa``); probed on MPS.
        supports_fp8: float8 (e4m3/e5m2) tensor-core matmul: SM >= 8.9; False elsewhere.
        total_memory_bytes: device memory in bytes (GPU), physical RAM in bytes (CPU), None if unknown.
        multiprocessor_count: number of SMs (CUDA); None elsewhere.
        torch_version: ``torch.__version__``.
        cuda_version: CUDA runtime torch was built with (``torch.version.cuda``); None on CPU/ROCm.
        hip_version: HIP runtime of a ROCm build (``torch.version.hip``); None otherwise.
        driver_version: GPU driver version string (pynvml, else ``/proc/driver/nvidia/version``); None
            when unreadable or not a CUDA device.
        cudnn_version: ``torch.backends.cudnn.version()`` (e.g. 90100) for CUDA devices, else None.
        cpu_vendor: ``"intel"``, ``"amd"``, ``"arm"``, ``"apple"`` or the raw vendor id; None if unknown.
        cpu_isa: lower-case ISA features of the host CPU: ``/proc/cpuinfo`` flags folded to
            {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512", "avx512_bf16", "avx512_vnni", "avx512_fp16",
            "amx", "amx_bf16", "amx_int8", "neon", "sve", "sve2", "bf16"} plus torch's
            ``get_cpu_capability()`` (e.g. "avx512"); empty when unreadable.
    """

    device_type: str
    index: int | None
    name: str
    sm: tuple[int, int] | None
    generation: GPUGeneration
    tensor_core_gen: int
    supports_bf16: bool
    supports_fp8: bool
    total_memory_bytes: int | None
    multiprocessor_count: int | None
    torch_version: str
    cuda_version: str | None
    driver_version: str | None
    cudnn_version: int | None
    cpu_vendor: str | None
    cpu_isa: frozenset[str]
    hip_version: str | None = None

    @classmethod
    def detect(cls, device: torch.device | str | int | None = None) -> DeviceSpec:
        """Describe ``device`` (memoized per ``(type, index)``).

        Args:
            device: a ``torch.device``, a string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``), an int
                (CUDA ordinal, like torch), or None for this machine's default accelerator: the current
                CUDA device if CUDA is available, else MPS if available, else the CPU. ``"cuda"`` without
                an index means the current CUDA device.

        Returns:
            The :class:`DeviceSpec`; the same object for every call with the same device.

        Raises:
            ConfigurationError: the device string is not a torch device; CUDA (or MPS) is asked for but
                not available; the CUDA ordinal is out of range. Never raises for the CPU.
        """
        device_type, index = _normalize(device)
        return _detect_cached(device_type, index)

    @staticmethod
    def clear_cache() -> None:
        """Forget every memoized :meth:`detect` result (tests that mock ``torch.cuda`` use this)."""
        _detect_cached.cache_clear()

    @property
    def sm_int(self) -> int:
        """Compute capability as ``major * 10 + minor`` (90 for SM 9.0); 0 when ``sm`` is None."""
        return 0 if self.sm is None else self.sm[0] * 10 + self.sm[1]

    def fingerprint_parts(self) -> dict[str, str]:
        """The parts a measured timing depends on, as strings, for the PerfDB fingerprint.

        Keys: ``name``, ``sm`` (``"9.0"`` or ``"none"``), ``driver``, ``cuda`` (the HIP version on ROCm,
        prefixed ``"hip-"``), ``torch``, ``cudnn``; a missing value is ``"none"``.
        """
        cuda = self.cuda_version or (f"hip-{self.hip_version}" if self.hip_version else None)
        return {
            "name": self.name,
            "sm": "none" if self.sm is None else f"{self.sm[0]}.{self.sm[1]}",
            "driver": self.driver_version or "none",
            "cuda": cuda or "none",
            "torch": self.torch_version,
            "cudnn": "none" if self.cudnn_version is None else str(self.cudnn_version),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (``generation`` by name, ``sm`` as a list, ``cpu_isa`` sorted)."""
        out: dict[str, Any] = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["sm"] = None if self.sm is None else list(self.sm)
        out["generation"] = self.generation.name
        out["cpu_isa"] = sorted(self.cpu_isa)
        return out

    def __str__(self) -> str:
        where = self.device_type if self.index is None else f"{self.device_type}:{self.index}"
        parts: list[str] = []
        if self.sm is not None:
            parts.append(f"sm_{self.sm_int} {self.generation.name} tensor-core gen {self.tensor_core_gen}")
        if self.cpu_vendor and self.device_type == "cpu":
            parts.append(self.cpu_vendor)
        if self.cpu_isa and self.device_type == "cpu":
            parts.append("isa " + ",".join(sorted(self.cpu_isa)))
        dtypes = [d for d, ok in (("bf16", self.supports_bf16), ("fp8", self.supports_fp8)) if ok]
        parts.append("dtypes " + ("+".join(dtypes) if dtypes else "fp32/fp16 only"))
        if self.total_memory_bytes is not None:
            parts.append(f"{self.total_memory_bytes / 2**30:.1f} GiB")
        if self.multiprocessor_count is not None:
            parts.append(f"{self.multiprocessor_count} SMs")
        versions = [f"torch {self.torch_version}"]
        for label, value in (
            ("cuda", self.cuda_version),
            ("hip", self.hip_version),
            ("driver", self.driver_version),
            ("cudnn", self.cudnn_version),
        ):
            if value is not None:
                versions.append(f"{label} {value}")
        return f"{where} {self.name} ({', '.join(parts)}) [{', '.join(versions)}]"


# ----------------------------------------------------------------------------------------------
# detection helpers (private)


def _bad(what: str, expected: str, got: Any, fix: str | None = None) -> ConfigurationError:
    return ConfigurationError(expected_got(f"DeviceSpec.detect: {what}", expected, got, fix))


def _normalize(device: torch.device | str | int | None) -> tuple[str, int | None]:
    """Turn any accepted device argument into ``(device_type, index)``; CUDA index resolved."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise _bad(
            "device",
            "a torch.device, a device string like 'cuda:0', an int CUDA ordinal or None",
            f"{type(device).__name__} {device!r}",
        )
    if isinstance(device, int):
        if device < 0:
            raise _bad("CUDA ordinal", "an int >= 0", device, "Pass 0 for the first GPU.")
        device = f"cuda:{device}"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _bad(
            "device", "a torch device string such as 'cpu', 'cuda', 'cuda:1' or 'mps'", repr(device),
            f"torch said: {exc}",
        ) from exc  # fmt: skip
    if dev.type == "cpu":
        return "cpu", None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise _bad(
                "CUDA device",
                "torch.cuda.is_available() == True",
                f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda})",
                "Install a CUDA build of torch and a driver, check CUDA_VISIBLE_DEVICES, "
                "or ask for device='cpu'.",
            )
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if not 0 <= index < count:
            raise _bad(
                "CUDA ordinal", f"0 <= index < {count} (visible CUDA devices)", index,
                "Use an ordinal below torch.cuda.device_count() or check CUDA_VISIBLE_DEVICES.",
            )  # fmt: skip
        return "cuda", index
    if dev.type == "mps" and not _mps_available():
        raise _bad(
            "MPS device", "torch.backends.mps.is_available() == True", "no MPS device",
            "MPS needs macOS on Apple silicon; ask for device='cpu' instead.",
        )  # fmt: skip
    return dev.type, dev.index


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


@functools.lru_cache(maxsize=64)
def _detect_cached(device_type: str, index: int | None) -> DeviceSpec:
    vendor, isa, cpu_name = _cpu_info()
    base: dict[str, Any] = dict(
        device_type=device_type, index=index, name=device_type, sm=None,
        generation=GPUGeneration.UNKNOWN, tensor_core_gen=0, supports_bf16=False, supports_fp8=False,
        total_memory_bytes=None, multiprocessor_count=None, torch_version=str(torch.__version__),
        cuda_version=None, driver_version=None, cudnn_version=None, cpu_vendor=vendor, cpu_isa=isa,
    )  # fmt: skip
    if device_type == "cuda":
        base.update(_cuda_fields(0 if index is None else index))
    elif device_type == "cpu":
        base.update(
            name=cpu_name or platform.machine() or "cpu",
            supports_bf16=True,
            total_memory_bytes=_physical_memory_bytes(),
        )
    elif device_type == "mps":
        base.update(name="Apple GPU (MPS)", supports_bf16=_mps_bf16())
    return DeviceSpec(**base)


def _cuda_fields(index: int) -> dict[str, Any]:
    """The CUDA-specific DeviceSpec fields of ordinal ``index`` (NVIDIA or ROCm build)."""
    props = torch.cuda.get_device_properties(index)
    hip = getattr(torch.version, "hip", None)
    if hip:
        # ROCm reports gfx versions through major/minor; they are not NVIDIA SMs.
        sm: tuple[int, int] | None = None
        generation = GPUGeneration.UNKNOWN
        try:
            bf16 = bool(torch.cuda.is_bf16_supported())
        except (RuntimeError, AssertionError):
            bf16 = False
    else:
        sm = (int(props.major), int(props.minor))
        generation = gpu_generation_from_sm(*sm)
        bf16 = sm >= (8, 0)
    try:
        cudnn = torch.backends.cudnn.version()
    except (RuntimeError, AttributeError):
        cudnn = None
    return dict(
        name=str(props.name), sm=sm, generation=generation,
        tensor_core_gen=tensor_core_generation(generation), supports_bf16=bf16,
        supports_fp8=sm is not None and sm >= (8, 9), total_memory_bytes=int(props.total_memory),
        multiprocessor_count=int(props.multi_processor_count), cuda_version=torch.version.cuda,
        hip_version=hip or None, driver_version=None if hip else _nvidia_driver_version(),
        cudnn_version=None if cudnn is None else int(cudnn),
    )  # fmt: skip


def _nvidia_driver_version() -> str | None:
    """Driver version from pynvml when importable, else the Linux kernel module's proc file."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                version = pynvml.nvmlSystemGetDriverVersion()
            finally:
                pynvml.nvmlShutdown()
            return version.decode() if isinstance(version, bytes) else str(version)
        except Exception as exc:  # pynvml raises its own NVMLError family
            logger.debug("pynvml could not read the driver version: %s", exc)
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            first = fh.readline()
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 ..."
    for token in first.split():
        if token[:1].isdigit() and token.count(".") >= 1:
            return token
    return None


def _mps_bf16() -> bool:
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps")
    except (RuntimeError, TypeError):
        return False
    return True


def _physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


_VENDORS = {"genuineintel": "intel", "authenticamd": "amd", "hygongenuine": "hygon"}
# /proc/cpuinfo flag -> LayerZero ISA name
_FLAG_MAP = {
    "sse4_2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "avx512f": "avx512", "avx512_bf16": "avx512_bf16", "avx512_vnni": "avx512_vnni",
    "avx512_fp16": "avx512_fp16", "amx_tile": "amx", "amx_bf16": "amx_bf16", "amx_int8": "amx_int8",
    "asimd": "neon", "sve": "sve", "sve2": "sve2", "bf16": "bf16",
}  # fmt: skip


def _parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str], str | None]:
    """(vendor, isa, model name) from the text of ``/proc/cpuinfo`` (first processor block)."""
    vendor: str | None = None
    name: str | None = None
    isa: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key == "vendor_id" and vendor is None:
            vendor = _VENDORS.get(value.lower(), value.lower() or None)
        elif key == "cpu implementer" and vendor is None:
            vendor = "arm"
        elif key == "model name" and name is None:
            name = value or None
        elif key in ("flags", "features") and not isa:
            isa = {_FLAG_MAP[f] for f in value.split() if f in _FLAG_MAP}
    return vendor, frozenset(isa), name


def _cpu_info() -> tuple[str | None, frozenset[str], str | None]:
    """Host CPU vendor, ISA features and model name; (None, empty, None) parts when unreadable."""
    vendor: str | None = None
    name: str | None = None
    isa: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            vendor, parsed, name = _parse_cpuinfo(fh.read())
            isa |= parsed
    except OSError:
        pass
    if vendor is None and platform.system() == "Darwin" and platform.machine() == "arm64":
        vendor = "apple"
        isa.add("neon")
    get_cap = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    if get_cap is not None:
        try:
            cap = str(get_cap()).strip().lower()
        except RuntimeError:
            cap = ""
        if cap and cap not in ("default", "no avx"):
            isa.add(cap.replace(" ", "_"))
    return vendor, frozenset(isa), name or (platform.processor() or None)


def device_free_bytes(device: DeviceSpec) -> int | None:
    """Free memory of a CUDA ``device`` in bytes (``torch.cuda.mem_get_info``: free device memory, not the
    caching allocator's reserve); None for other devices or when the reading fails."""
    if device.device_type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.mem_get_info(device.index if device.index is not None else 0)[0])
    except RuntimeError:
        return None
