"""Detection of the FlashAttention libraries, imported lazily (only when these functions run).

Three libraries, three LayerZero backends (see ``docs/backends.md``, "flash_attn"):

====================  ========================  ===================================================
backend id            Python module             what it is
====================  ========================  ===================================================
``flash_attn2``       ``flash_attn``            FlashAttention-2 (Dao 2023), ``pip install flash-attn``
``flash_attn3``       ``flash_attn_interface``  FlashAttention-3 (Shah et al. 2024), Hopper only,
                                                built from ``hopper/`` of the flash-attention repo
``flash_attn4``       ``flash_attn.cute``       FlashAttention-4, CuTe-DSL kernels (Blackwell)
====================  ========================  ===================================================

A missing or broken library never raises here: :func:`probe` returns a :class:`Probe` whose
:class:`BackendSpec` is unavailable with a ``BACKEND_NOT_INSTALLED`` (module absent),
``BACKEND_IMPORT_FAILED`` (module present, import raised, e.g. a CUDA ABI mismatch) or
``BACKEND_VERSION_UNSUPPORTED`` reason carrying the import error's text.
"""

from __future__ import annotations

import enum
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import BackendSpec
from layerzero.core.versions import release

log = logging.getLogger("layerzero.backends.flash_attn")


class FlashVersion(str, enum.Enum):
    """Which FlashAttention generation a backend wraps; the value is the LayerZero backend id."""

    FA2 = "flash_attn2"
    FA3 = "flash_attn3"
    FA4 = "flash_attn4"


@dataclass(frozen=True, slots=True)
class LibraryInfo:
    """Static facts about one FlashAttention library: the module to import, the attribute holding the
    forward function, the pip/ build hint shown when it is missing, and a one-line description."""

    version: FlashVersion
    module: str
    function: str
    install_hint: str
    description: str


LIBRARIES: dict[FlashVersion, LibraryInfo] = {
    FlashVersion.FA2: LibraryInfo(
        FlashVersion.FA2,
        "flash_attn",
        "flash_attn_func",
        "pip install flash-attn --no-build-isolation (needs a CUDA build of torch, SM 8.0+)",
        "FlashAttention-2 (Dao 2023, arXiv:2307.08691), module flash_attn",
    ),
    FlashVersion.FA3: LibraryInfo(
        FlashVersion.FA3,
        "flash_attn_interface",
        "flash_attn_func",
        "build hopper/ of github.com/Dao-AILab/flash-attention (python setup.py install) on an SM 9.0 GPU",
        "FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608), Hopper only, module flash_attn_interface",
    ),
    FlashVersion.FA4: LibraryInfo(
        FlashVersion.FA4,
        "flash_attn.cute",
        "flash_attn_func",
        "pip install flash-attn-4 (older releases: flash-attn-cute; the flash_attn/cute package of "
        "github.com/Dao-AILab/flash-attention, needs nvidia-cutlass-dsl)",
        "FlashAttention-4 (CuTe DSL, Blackwell), module flash_attn.cute",
    ),
}

MIN_FA2_VERSION = (2, 1)
"""FA2 releases before 2.1 aligned causal masks top-left; we require 2.1+ (bottom-right, GQA, stable API)."""


@dataclass(frozen=True, slots=True)
class Probe:
    """Result of probing one library: its :class:`BackendSpec` (available or not, with reasons) and, when
    available, the forward function (``flash_attn_func``) that the kernel will call; ``None`` otherwise."""

    backend: BackendSpec
    function: Callable[..., Any] | None


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    """``"2.7.4.post1"`` -> ``(2, 7, 4)``; None when unparsable."""
    return release(text) or None


def _unavailable(info: LibraryInfo, code: ReasonCode, message: str, version: str | None = None) -> Probe:
    log.info("LayerZero backend %s unavailable: %s", info.version.value, message)
    return Probe(
        BackendSpec(
            info.version.value, info.module, version, False, (Reason(code, message),), info.description
        ),
        None,
    )


def probe(which: FlashVersion, importer: Callable[[str], Any] = importlib.import_module) -> Probe:
    """Import the library of ``which`` (lazily, now) and describe it as a backend.

    Args:
        which: the FlashAttention generation to probe.
        importer: ``importlib.import_module`` (tests inject fakes through ``sys.modules`` instead).

    Returns:
        A :class:`Probe`. Never raises for a missing or broken library: the BackendSpec is unavailable with
        ``BACKEND_NOT_INSTALLED`` (the module or one of its parents is absent; the message has the
        ImportError text and the install hint), ``BACKEND_IMPORT_FAILED`` (importing raised something else,
        or ``flash_attn_func`` is missing) or ``BACKEND_VERSION_UNSUPPORTED`` (FA2 older than 2.1).
    """
    info = LIBRARIES[which]
    try:
        module = importer(info.module)
    except ModuleNotFoundError as exc:
        return _unavailable(
            info,
            ReasonCode.BACKEND_NOT_INSTALLED,
            f"module {info.module!r} is not installed ({exc}); install: {info.install_hint}",
        )
    except Exception as exc:  # a present but broken build raises ImportError, OSError, RuntimeError, ...
        return _unavailable(
            info,
            ReasonCode.BACKEND_IMPORT_FAILED,
            f"importing {info.module!r} failed: {type(exc).__name__}: {exc}",
        )
    raw = getattr(module, "__version__", None)
    version = None if raw is None else str(raw)
    fn = getattr(module, info.function, None)
    if not callable(fn):
        return _unavailable(
            info,
            ReasonCode.BACKEND_IMPORT_FAILED,
            f"module {info.module!r} (version {version}) has no callable {info.function}; "
            "it is not the FlashAttention API LayerZero wraps",
            version,
        )
    if which is FlashVersion.FA2:
        parsed = _version_tuple(version)
        if parsed is None or parsed[:2] < MIN_FA2_VERSION:
            return _unavailable(
                info,
                ReasonCode.BACKEND_VERSION_UNSUPPORTED,
                f"flash_attn {version} is older than 2.1 (or has no __version__); causal masks "
                "before 2.1 were top-left aligned. Upgrade: pip install -U flash-attn",
                version,
            )
    return Probe(BackendSpec(info.version.value, info.module, version, True, (), info.description), fn)
