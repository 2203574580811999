"""The ``liger`` backend: Liger-Kernel's Triton RMSNorm (plain and fused residual add), RoPE, SwiGLU,
LayerNorm and fused linear cross-entropy, CUDA only.

Nothing is imported at ``import layerzero`` time: :func:`register` (run on the first op call) calls
:func:`probe`, which imports ``liger_kernel.ops.rms_norm``, ``.fused_add_rms_norm``, ``.rope`` and ``.swiglu``
(the default Triton implementations, not the per-device replacements of ``liger_kernel.ops``). A missing
library leaves the backend registered and unavailable with ``BACKEND_NOT_INSTALLED``; an import that raises
anything else (no triton, a torch ABI mismatch) gives ``BACKEND_IMPORT_FAILED`` with the error text.
Constraints and sources: ``kernels.py`` and ``docs/backends.md`` ("liger").
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec

from .._optional import dist_version, import_modules, unavailable_backend, unavailable_why
from .kernels import INSTALL_HINT, KERNEL_IDS, kernel_specs

log = logging.getLogger("layerzero.backends.liger")
BACKEND_ID = "liger"
MODULE = "liger_kernel"
_DESCRIPTION = (
    "Liger-Kernel Triton kernels (RMSNorm, fused add + RMSNorm, RoPE, SwiGLU, LayerNorm, fused linear "
    "cross-entropy)"
)


@dataclass(frozen=True, slots=True)
class LigerProbe:
    """Result of :func:`probe`: the :class:`BackendSpec` (available or not, with reasons) and, when usable,
    ``functions`` = ``{"rms_norm", "fused_add_rms_norm" (None if absent), "rope", "swiglu", "layer_norm",
    "linear_cross_entropy" (the last three None if absent)}``
    autograd Functions."""

    backend: BackendSpec
    functions: dict[str, Any] | None


def _unavailable(reason: Reason, version: str | None = None) -> LigerProbe:
    return LigerProbe(unavailable_backend(BACKEND_ID, MODULE, _DESCRIPTION, reason, version), None)


def probe() -> LigerProbe:
    """Import Liger-Kernel now and describe the backend; never raises for a missing or broken library."""
    modules, why = import_modules(
        MODULE, ("liger_kernel.ops.rms_norm", "liger_kernel.ops.rope"), INSTALL_HINT
    )
    if why is not None:
        return _unavailable(why)
    rms, rope = modules
    version = dist_version("liger-kernel", importlib.import_module(MODULE))
    plain = getattr(rms, "LigerRMSNormFunction", None)
    function = getattr(rope, "LigerRopeFunction", None)
    if plain is None or function is None:
        return _unavailable(
            Reason(
                ReasonCode.BACKEND_VERSION_UNSUPPORTED,
                f"liger_kernel {version} lacks LigerRMSNormFunction/LigerRopeFunction; upgrade it",
            ),
            version,
        )
    fused = _optional("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction", version)
    swiglu = _optional("liger_kernel.ops.swiglu", "LigerSiLUMulFunction", version)
    layer_norm = _optional("liger_kernel.ops.layer_norm", "LigerLayerNormFunction", version)
    lce = _optional(
        "liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction", version
    )
    backend = BackendSpec(BACKEND_ID, MODULE, version, True, (), _DESCRIPTION)
    return LigerProbe(
        backend,
        {
            "rms_norm": plain,
            "fused_add_rms_norm": fused,
            "rope": function,
            "swiglu": swiglu,
            "layer_norm": layer_norm,
            "linear_cross_entropy": lce,
        },
    )


def _optional(module: str, name: str, version: str | None) -> Any:
    """``module.name`` or None (logged) when this Liger lacks it: its kernel is then rejected, not the
    backend."""
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        found = None
    if found is None:
        log.info("liger_kernel %s has no %s.%s; its op will use other kernels", version, module, name)
    return found


def register(registry: KernelRegistry) -> None:
    """Add the ``liger`` backend (available or not, with reasons) and its ``liger.rms_norm`` / ``liger.rope``
    / ``liger.swiglu`` / ``liger.layer_norm`` / ``liger.linear_cross_entropy`` kernels to ``registry`` (their
    ops must already be registered).

    Raises:
        ConfigurationError: the backend or one of its kernel ids is already registered.
    """
    p = probe()
    registry.add_backend(p.backend)
    why = unavailable_why(p.backend, "liger_kernel is not available")
    for spec in kernel_specs(p.functions, why):
        registry.add_kernel(spec)


__all__ = ["BACKEND_ID", "KERNEL_IDS", "LigerProbe", "kernel_specs", "probe", "register"]
