"""The ``flashinfer`` backend: FlashInfer's batch decode / prefill attention (Ye et al. 2025, "FlashInfer:
Efficient and Customizable Attention Engine for LLM Inference Serving"), CUDA only.

Kernels (``kernels.py`` has the constraints and the sources they come from):

- ``flashinfer.attention`` (op ``attention``): dense decode through the paged batch decode wrapper over the
  KV viewed as pages, dense prefill through the ragged batch prefill wrapper.
- ``flashinfer.paged_attention`` (op ``paged_attention``): paged decode and prefill/append on LayerZero's
  one-tensor cache, ``plan()`` once per batch and ``run()`` per layer through a plan cache (``plan.py``).

Nothing is imported at ``import layerzero`` time: :func:`register` (run on the first op call) calls
:func:`probe`, which imports ``flashinfer``. A missing library leaves the backend registered and unavailable
with ``BACKEND_NOT_INSTALLED``; an import that raises anything else (a torch/CUDA ABI mismatch, a missing
``tvm_ffi``) gives ``BACKEND_IMPORT_FAILED`` with the error text; a release without the plan/run wrappers
(before 0.2) gives ``BACKEND_VERSION_UNSUPPORTED``. FlashInfer JIT-compiles each new kernel on first use
(~6 s): warm up with ``lz.warmup`` (calls the chosen kernel once) or ``lz.tune`` before serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec
from layerzero.core.versions import release

from .._optional import dist_version, import_modules, unavailable_backend, unavailable_why
from .kernels import INSTALL_HINT, KERNEL_IDS, FlashInferKernels, kernel_specs
from .plan import PlanCache, PlanStats, paged_csr, tensor_identity

log = logging.getLogger("layerzero.backends.flashinfer")
BACKEND_ID = "flashinfer"
MODULE = "flashinfer"
MIN_VERSION = (0, 2)
"""plan()/run() wrappers (and the single 5-D paged cache tensor) exist since FlashInfer 0.2."""
WRAPPERS = (
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
)
_DESCRIPTION = "FlashInfer batch decode / prefill attention, paged KV with plan()/run() (JIT-compiled CUDA)"


@dataclass(frozen=True, slots=True)
class FlashInferProbe:
    """Result of :func:`probe`: the :class:`BackendSpec` (available or not, with reasons) and, when usable,
    the imported ``flashinfer`` module."""

    backend: BackendSpec
    module: Any | None


def _unavailable(reason: Reason, version: str | None = None) -> FlashInferProbe:
    return FlashInferProbe(unavailable_backend(BACKEND_ID, MODULE, _DESCRIPTION, reason, version), None)


def probe() -> FlashInferProbe:
    """Import FlashInfer now and describe the backend; never raises for a missing or broken library.

    Returns:
        A :class:`FlashInferProbe`: available with the module, or unavailable with ``BACKEND_NOT_INSTALLED``
        (module absent), ``BACKEND_IMPORT_FAILED`` (import raised) or ``BACKEND_VERSION_UNSUPPORTED``
        (older than 0.2, or a wrapper class missing).
    """
    modules, why = import_modules(MODULE, (MODULE,), INSTALL_HINT)
    if why is not None:
        return _unavailable(why)
    module = modules[0]
    version = dist_version("flashinfer-python", module)
    parsed = release(version)
    missing = [name for name in WRAPPERS if not callable(getattr(module, name, None))]
    if (parsed and parsed[:2] < MIN_VERSION) or missing:
        return _unavailable(
            Reason(
                ReasonCode.BACKEND_VERSION_UNSUPPORTED,
                f"flashinfer {version} is older than 0.2 or lacks {missing or WRAPPERS}; "
                "upgrade: pip install -U flashinfer-python",
            ),
            version,
        )
    return FlashInferProbe(BackendSpec(BACKEND_ID, MODULE, version, True, (), _DESCRIPTION), module)


def register(registry: KernelRegistry) -> None:
    """Add the ``flashinfer`` backend (available or not, with reasons) and its ``flashinfer.attention`` /
    ``flashinfer.paged_attention`` kernels to ``registry`` (the ``attention`` and ``paged_attention`` ops must
    already be registered). Each call makes a new backend instance (its own workspaces and plan cache).

    Raises:
        ConfigurationError: the backend or one of its kernel ids is already registered.
    """
    p = probe()
    registry.add_backend(p.backend)
    kernels = FlashInferKernels(p.module) if p.module is not None else None
    why = unavailable_why(p.backend, "flashinfer is not available")
    for spec in kernel_specs(kernels, why):
        registry.add_kernel(spec)


def backend_kernels(registry: KernelRegistry) -> FlashInferKernels | None:
    """The :class:`FlashInferKernels` instance registered in ``registry`` (None when FlashInfer is missing
    or its kernels are not registered there)."""
    try:
        fn = registry.kernel(KERNEL_IDS[1]).fn
    except Exception:  # noqa: BLE001 - not registered: no instance
        return None
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, FlashInferKernels) else None


def plan_stats(registry: KernelRegistry) -> PlanStats | None:
    """Plan-cache counters (hits, misses, evictions, size, capacity) of the FlashInfer backend registered in
    ``registry`` (e.g. ``layerzero.core.runtime.RUNTIME.registry``); None when FlashInfer is unavailable.

    A serving step with L layers should show 1 miss and L - 1 hits per batch layout."""
    kernels = backend_kernels(registry)
    return None if kernels is None else kernels.plan_stats()


__all__ = [
    "BACKEND_ID",
    "KERNEL_IDS",
    "FlashInferKernels",
    "FlashInferProbe",
    "PlanCache",
    "PlanStats",
    "backend_kernels",
    "kernel_specs",
    "paged_csr",
    "plan_stats",
    "probe",
    "register",
    "tensor_identity",
]
