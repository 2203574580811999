"""Unit tests of layerzero.core.device: SM -> generation table, mocked CUDA detection, real CPU detection."""

from __future__ import annotations

import dataclasses
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from layerzero.core import device as devmod
from layerzero.core.device import (
    DeviceSpec,
    GPUGeneration,
    gpu_generation_from_sm,
    tensor_core_generation,
)
from layerzero.core.errors import ConfigurationError, InvalidInputError

pytestmark = pytest.mark.unit

G = GPUGeneration

# (major, minor) -> (generation, tensor-core gen, bf16, fp8): the table written out by hand from the
# CUDA programming guide, independent of the module's own table.
SM_TABLE = [
    ((6, 1), G.UNKNOWN, 0, False, False),
    ((7, 0), G.UNKNOWN, 0, False, False),
    ((7, 5), G.TURING, 2, False, False),
    ((8, 0), G.AMPERE, 3, True, False),
    ((8, 6), G.AMPERE, 3, True, False),
    ((8, 7), G.AMPERE, 3, True, False),
    ((8, 9), G.ADA_LOVELACE, 4, True, True),
    ((9, 0), G.HOPPER, 4, True, True),
    ((10, 0), G.BLACKWELL, 5, True, True),
    ((10, 3), G.BLACKWELL, 5, True, True),
    ((11, 0), G.BLACKWELL, 5, True, True),
    ((12, 0), G.BLACKWELL, 5, True, True),
]


@pytest.fixture(autouse=True)
def _fresh_cache():
    DeviceSpec.clear_cache()
    yield
    DeviceSpec.clear_cache()


def test_generation_enum_is_ordered():
    order = [G.UNKNOWN, G.TURING, G.AMPERE, G.ADA_LOVELACE, G.HOPPER, G.BLACKWELL]
    assert [int(g) for g in order] == [0, 1, 2, 3, 4, 5]
    assert G.HOPPER >= G.AMPERE and not (G.TURING >= G.AMPERE)


@pytest.mark.parametrize(("sm", "gen", "tc", "bf16", "fp8"), SM_TABLE, ids=lambda x: str(x))
def test_gpu_generation_from_sm(sm, gen, tc, bf16, fp8):
    assert gpu_generation_from_sm(*sm) is gen
    assert tensor_core_generation(gen) == tc


@pytest.mark.parametrize("bad", [(-1, 0), (8, -1), (8.0, 0), ("9", 0), (True, 0)])
def test_gpu_generation_from_sm_rejects_bad_input(bad):
    with pytest.raises(InvalidInputError, match="expected a non-negative int"):
        gpu_generation_from_sm(*bad)


# ---------------------------------------------------------------------------------------------
# mocked CUDA


class FakeCuda:
    """Installs a fake torch.cuda with the given devices ``[(name, (major, minor)), ...]``."""

    def __init__(self, monkeypatch, devices, current=0, hip=None, bf16_supported=False):
        self.calls = 0
        self.devices = devices

        def props(index):
            self.calls += 1
            name, (major, minor) = devices[index]
            return SimpleNamespace(name=name, major=major, minor=minor, total_memory=80 * 2**30,
                                   multi_processor_count=132)  # fmt: skip

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "get_device_properties", props)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
        monkeypatch.setattr(torch.version, "cuda", None if hip else "12.4")
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
        monkeypatch.setattr(devmod, "_nvidia_driver_version", lambda: "550.54.15")


@pytest.mark.parametrize(("sm", "gen", "tc", "bf16", "fp8"), SM_TABLE, ids=lambda x: str(x))
def test_detect_mocked_cuda(monkeypatch, sm, gen, tc, bf16, fp8):
    FakeCuda(monkeypatch, [("NVIDIA Fake", sm)])
    spec = DeviceSpec.detect("cuda:0")
    assert (spec.device_type, spec.index, spec.name) == ("cuda", 0, "NVIDIA Fake")
    assert spec.sm == sm and spec.sm_int == sm[0] * 10 + sm[1]
    assert spec.generation is gen and spec.tensor_core_gen == tc
    assert spec.supports_bf16 is bf16 and spec.supports_fp8 is fp8
    assert spec.total_memory_bytes == 80 * 2**30 and spec.multiprocessor_count == 132
    assert (spec.cuda_version, spec.driver_version, spec.cudnn_version) == ("12.4", "550.54.15", 90100)


def test_detect_mocked_cuda_resolves_index_and_memoizes(monkeypatch):
    fake = FakeCuda(monkeypatch, [("A100", (8, 0)), ("H100", (9, 0))], current=1)
    first = DeviceSpec.detect("cuda")  # no index -> current device
    assert (first.index, first.name) == (1, "H100")
    assert DeviceSpec.detect(1) is first
    assert DeviceSpec.detect(torch.device("cuda", 1)) is first
    assert DeviceSpec.detect() is first  # default: the current CUDA device
    assert fake.calls == 1
    assert DeviceSpec.detect("cuda:0").name == "A100"
    assert fake.calls == 2


def test_detect_mocked_cuda_bad_ordinal(monkeypatch):
    FakeCuda(monkeypatch, [("A100", (8, 0)), ("A100", (8, 0))])
    with pytest.raises(ConfigurationError, match=r"0 <= index < 2.*got 5"):
        DeviceSpec.detect("cuda:5")
    with pytest.raises(ConfigurationError, match="an int >= 0"):
        DeviceSpec.detect(-1)


def test_detect_mocked_rocm(monkeypatch):
    FakeCuda(monkeypatch, [("AMD Instinct MI300X", (9, 4))], hip="6.2.1", bf16_supported=True)
    spec = DeviceSpec.detect("cuda")
    # gfx942 reports 9.4: it must not be mistaken for an NVIDIA Hopper.
    assert spec.sm is None and spec.generation is G.UNKNOWN and spec.tensor_core_gen == 0
    assert spec.supports_bf16 and not spec.supports_fp8
    assert spec.hip_version == "6.2.1" and spec.cuda_version is None and spec.driver_version is None
    assert spec.fingerprint_parts()["cuda"] == "hip-6.2.1"


def test_spec_serialization_and_str(monkeypatch):
    FakeCuda(monkeypatch, [("NVIDIA H100 80GB HBM3", (9, 0))])
    spec = DeviceSpec.detect("cuda:0")
    assert spec.fingerprint_parts() == {
        "name": "NVIDIA H100 80GB HBM3",
        "sm": "9.0",
        "driver": "550.54.15",
        "cuda": "12.4",
        "torch": torch.__version__,
        "cudnn": "90100",
    }
    d = json.loads(json.dumps(spec.to_dict()))
    assert d["sm"] == [9, 0] and d["generation"] == "HOPPER" and d["supports_fp8"] is True
    assert set(d) == {f.name for f in dataclasses.fields(DeviceSpec)}
    assert d["cpu_isa"] == sorted(spec.cpu_isa)
    text = str(spec)
    for piece in ("cuda:0", "NVIDIA H100 80GB HBM3", "sm_90", "HOPPER", "fp8", "132 SMs", "driver 550.54.15"):
        assert piece in text


def test_spec_is_frozen_and_slotted():
    spec = DeviceSpec.detect("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    assert not hasattr(spec, "__dict__")


# ---------------------------------------------------------------------------------------------
# real CPU


def test_detect_real_cpu():
    spec = DeviceSpec.detect("cpu")
    assert spec is DeviceSpec.detect(torch.device("cpu"))
    assert (spec.device_type, spec.index, spec.sm, spec.sm_int) == ("cpu", None, None, 0)
    assert spec.generation is G.UNKNOWN and spec.tensor_core_gen == 0
    assert spec.supports_bf16 and not spec.supports_fp8
    assert spec.torch_version == torch.__version__
    assert spec.cuda_version is None and spec.cudnn_version is None and spec.driver_version is None
    assert isinstance(spec.cpu_isa, frozenset) and all(
        isinstance(f, str) and f == f.lower() for f in spec.cpu_isa
    )
    assert spec.name
    fp = spec.fingerprint_parts()
    assert fp["sm"] == "none" and fp["cuda"] == "none" and all(isinstance(v, str) for v in fp.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/cpuinfo is Linux only")
def test_real_cpu_isa_matches_proc_cpuinfo():
    flags: set[str] = set()
    vendor_id = None
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
            if key.strip() == "vendor_id" and vendor_id is None:
                vendor_id = value.strip()
    isa = DeviceSpec.detect("cpu").cpu_isa
    for flag, name in (("avx2", "avx2"), ("avx512f", "avx512"), ("amx_tile", "amx"), ("asimd", "neon")):
        assert (name in isa) == (flag in flags) or name == torch.backends.cpu.get_cpu_capability().lower()
    if vendor_id == "GenuineIntel":
        assert DeviceSpec.detect("cpu").cpu_vendor == "intel"
    if vendor_id == "AuthenticAMD":
        assert DeviceSpec.detect("cpu").cpu_vendor == "amd"
    cap = torch.backends.cpu.get_cpu_capability().lower()
    if cap not in ("default", "no avx"):
        assert cap in isa


def test_parse_cpuinfo_samples():
    intel = (
        "vendor_id\t: GenuineIntel\nmodel name\t: Intel Xeon\nflags\t\t: sse4_2 avx avx2 avx512f amx_tile "
        "amx_bf16\n"
    )
    assert devmod._parse_cpuinfo(intel) == ("intel", frozenset({"sse4_2", "avx", "avx2", "avx512", "amx",
        "amx_bf16"}),
                                            "Intel Xeon")  # fmt: skip
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16\nCPU implementer\t: 0x41\n"
    assert devmod._parse_cpuinfo(arm) == ("arm", frozenset({"neon", "sve", "bf16"}), None)
    assert devmod._parse_cpuinfo("garbage without colons") == (None, frozenset(), None)


def test_driver_version_from_proc_when_no_pynvml(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    fake = tmp_path / "version"
    fake.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    )
    real_open = open
    monkeypatch.setattr(devmod, "open", lambda p, *a, **k: real_open(fake if p ==
        "/proc/driver/nvidia/version" else p,
                                                                      *a, **k), raising=False)  # fmt: skip
    assert devmod._nvidia_driver_version() == "550.54.15"
    fake.unlink()
    assert devmod._nvidia_driver_version() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_request_without_cuda_raises():
    with pytest.raises(
        ConfigurationError, match=r"CUDA device: expected torch.cuda.is_available\(\) == True"
    ):
        DeviceSpec.detect("cuda")
    with pytest.raises(ConfigurationError, match="CUDA device"):
        DeviceSpec.detect(0)


def test_detect_default_never_raises_without_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devmod, "_mps_available", lambda: False)
    assert DeviceSpec.detect().device_type == "cpu"


@pytest.mark.parametrize("bad", ["bogus", "cuda:x", 3.5, object()])
def test_detect_rejects_garbage(bad):
    with pytest.raises(ConfigurationError, match="DeviceSpec.detect: device: expected"):
        DeviceSpec.detect(bad)
