"""The ``ipex`` backend: Intel Extension for PyTorch's CPU RMSNorm and paged attention (see ``kernels.py``).

Nothing is imported at ``import layerzero`` time: :func:`register` (run on the first op call) calls
:func:`probe`. IPEX releases pin one torch minor version, and importing a mismatched IPEX prints an error and
then fails inside its ``__init__`` (2.8.0 calls the non-existent ``os.exit``), so the probe first compares the
installed distribution's version with torch's and reports a mismatch as ``BACKEND_IMPORT_FAILED`` *without*
importing it. A missing package gives ``BACKEND_NOT_INSTALLED``; an import that raises anything (including
IPEX's ``sys.exit`` on a CPU without AVX2) gives ``BACKEND_IMPORT_FAILED`` with the text; an IPEX without
``llm.functional.rms_norm`` / ``add_rms_norm`` or ``llm.modules.PagedAttention`` gives
``BACKEND_VERSION_UNSUPPORTED``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec
from layerzero.core.versions import release

from .._optional import dist_version, import_modules, unavailable_backend, unavailable_why
from .kernels import INSTALL_HINT, KERNEL_IDS, kernel_specs

log = logging.getLogger("layerzero.backends.ipex")
BACKEND_ID = "ipex"
MODULE = "intel_extension_for_pytorch"
DISTRIBUTION = "intel_extension_for_pytorch"
_DESCRIPTION = "Intel Extension for PyTorch CPU kernels (RMSNorm, fused add + RMSNorm, paged attention)"


@dataclass(frozen=True, slots=True)
class IpexProbe:
    """Result of :func:`probe`: the :class:`BackendSpec` (available or not, with reasons) and, when usable,
    ``api`` = ``{"functional": ipex.llm.functional, "paged": ipex.llm.modules.PagedAttention}``."""

    backend: BackendSpec
    api: dict[str, Any] | None


def _minor(version: str | None) -> str | None:
    """``"2.8.0+cpu"`` -> ``"2.8"`` (None when unparsable)."""
    parts = release(version)
    return f"{parts[0]}.{parts[1]}" if len(parts) >= 2 else None


def _mismatch(version: str | None) -> str | None:
    """IPEX's own torch-mismatch message when ``version``'s major.minor differs from torch's, else None."""
    ipex_minor, torch_minor = _minor(version), _minor(torch.__version__)
    if ipex_minor is None or torch_minor is None or ipex_minor == torch_minor:
        return None
    return (
        f"Intel(R) Extension for PyTorch* needs to work with PyTorch {ipex_minor}.*, but PyTorch "
        f"{torch.__version__} is found (intel_extension_for_pytorch {version}). Install the IPEX release "
        f"matching torch {torch_minor}, or torch {ipex_minor}.*"
    )


def _unavailable(code: ReasonCode, message: str, version: str | None = None) -> IpexProbe:
    return IpexProbe(
        unavailable_backend(BACKEND_ID, MODULE, _DESCRIPTION, Reason(code, message), version), None
    )


def _dist_version() -> str | None:
    """The installed intel-extension-for-pytorch version, read without importing it (the import itself fails
    or exits on a torch mismatch)."""
    return dist_version(DISTRIBUTION)


def probe() -> IpexProbe:
    """Check and import IPEX now and describe the backend; never raises for a missing or broken library."""
    version = _dist_version()
    why = _mismatch(version)
    if why is not None:
        return _unavailable(ReasonCode.BACKEND_IMPORT_FAILED, why, version)
    modules, failed = import_modules(
        MODULE, (MODULE, f"{MODULE}.llm.functional", f"{MODULE}.llm.modules"), INSTALL_HINT
    )
    if failed is not None:
        return IpexProbe(unavailable_backend(BACKEND_ID, MODULE, _DESCRIPTION, failed, version), None)
    mod, functional, modules = modules
    if version is None:  # no distribution metadata: check the imported module's own version
        version = getattr(mod, "__version__", None)
        why = _mismatch(version)
        if why is not None:
            return _unavailable(ReasonCode.BACKEND_IMPORT_FAILED, why, version)
    paged = getattr(modules, "PagedAttention", None)
    missing = [
        name
        for name, obj in (
            ("llm.functional.rms_norm", getattr(functional, "rms_norm", None)),
            ("llm.functional.add_rms_norm", getattr(functional, "add_rms_norm", None)),
            ("llm.modules.PagedAttention", paged),
        )
        if obj is None
    ]
    if missing:
        return _unavailable(
            ReasonCode.BACKEND_VERSION_UNSUPPORTED,
            f"intel_extension_for_pytorch {version} lacks {missing}; use IPEX >= 2.3",
            version,
        )
    backend = BackendSpec(BACKEND_ID, MODULE, version, True, (), _DESCRIPTION)
    return IpexProbe(backend, {"functional": functional, "paged": paged})


def register(registry: KernelRegistry) -> None:
    """Add the ``ipex`` backend (available or not, with reasons) and its ``ipex.rms_norm`` /
    ``ipex.paged_attention`` kernels to ``registry`` (the ``rms_norm`` and ``paged_attention`` ops must
    already be registered).

    Raises:
        ConfigurationError: the backend or one of its kernel ids is already registered.
    """
    p = probe()
    registry.add_backend(p.backend)
    why = unavailable_why(p.backend, f"{MODULE} is not available")
    for spec in kernel_specs(p.api, why):
        registry.add_kernel(spec)


__all__ = ["BACKEND_ID", "KERNEL_IDS", "IpexProbe", "kernel_specs", "probe", "register"]
