"""LayerZero: the fastest correct kernel for *these* inputs on *this* machine, with every reason visible.

>>> import torch, layerzero as lz
>>> q = k = v = torch.randn(1, 8, 16, 64)
>>> out = lz.attention(q, k, v, is_causal=True)
>>> print(lz.explain("attention", q, k, v, is_causal=True))  # doctest: +SKIP

Importing ``layerzero`` needs only torch, pyyaml and numpy, reads no environment and loads no backend:
that happens on the first op call.
"""

from __future__ import annotations

from typing import Any

from .api import (
    TuneReport,
    configure,
    disabled,
    explain,
    get_config,
    get_locks,
    kernel,
    list_kernels,
    load_capabilities,
    load_config,
    lock,
    prefer,
    register_kernel,
    reload,
    select,
    trace,
    tune,
    unlock,
    unregister_kernel,
    validate,
    which,
)
from .core.errors import (
    BackendNotAvailableError,
    CacheCorruptionError,
    ConfigurationError,
    CudaGraphUnsafeError,
    InvalidInputError,
    KernelExecutionError,
    LayerZeroError,
    NoKernelFoundError,
    PolicyValidationError,
    SelectionTimeoutError,
    UnknownKernelError,
    UnknownOperationError,
)
from .core.reasons import Reason, ReasonCode
from .core.report import SelectionReport
from .core.specs import ExecutionPlan, KernelSpec
from .graphs import GraphCheck, is_graph_safe, validate_graph_capture, warmup
from .ops import (
    allocate_kv_cache,
    apply_penalties,
    attention,
    fused_moe,
    geglu,
    layer_norm,
    paged_attention,
    reglu,
    reshape_and_cache,
    rms_norm,
    rope,
    sample,
    sample_topk,
    sample_topp,
    swiglu,
)

__version__ = "0.1.0"


def doctor(*, print_report: bool = True) -> Any:
    """Inspect this machine and LayerZero's state: device, versions, backends (available or why not),
    kernels per op, config, policy, locks, health and PerfDB. Returns a :class:`~layerzero.diagnostics.DoctorReport`
    (``.to_dict()`` for JSON) and prints it as tables unless ``print_report=False``. Raises
    ``ConfigurationError`` for malformed ``LAYERZERO_*`` variables; an unusable PerfDB is reported, not raised."""
    from .diagnostics import run_doctor

    return run_doctor(print_report=print_report)


def patch_model(model: Any, **kwargs: Any) -> Any:
    """Route a Hugging Face Transformers model's attention, RMSNorm and RoPE through LayerZero; returns an
    undo handle. See :func:`layerzero.integrations.transformers.patch_model` (imports transformers lazily).
    Raises ``ConfigurationError`` for an unsupported ``model_type``, a model patched twice or a transformers
    release older than 4.56."""
    from .integrations.transformers import patch_model as _patch

    return _patch(model, **kwargs)


__all__ = [
    "BackendNotAvailableError", "CacheCorruptionError", "ConfigurationError", "CudaGraphUnsafeError",
    "ExecutionPlan", "InvalidInputError", "KernelExecutionError", "KernelSpec", "LayerZeroError",
    "NoKernelFoundError", "PolicyValidationError", "Reason", "ReasonCode", "SelectionReport",
    "SelectionTimeoutError", "UnknownKernelError", "UnknownOperationError", "__version__", "allocate_kv_cache", "attention",
    "configure", "disabled", "doctor", "explain", "fused_moe", "get_config", "get_locks", "layer_norm", "list_kernels",
    "load_capabilities", "load_config", "lock", "paged_attention", "patch_model", "prefer", "reload", "reshape_and_cache", "rms_norm", "rope", "sample", "sample_topk", "sample_topp", "apply_penalties", "swiglu",
    "geglu", "reglu", "select", "trace", "TuneReport", "tune", "unlock", "validate", "which",
    "kernel", "register_kernel", "unregister_kernel",
    "GraphCheck", "is_graph_safe", "validate_graph_capture", "warmup",
]
