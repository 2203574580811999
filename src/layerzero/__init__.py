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

from . import _wiring  # noqa: F401 - installs core's runtime hooks (the ops loader, autotune, canary)
from ._version import __version__
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
from .block_plan import BlockOp, BlockPlan, plan_block
from .core.errors import (
    BackendNotAvailableError,
    CacheCorruptionError,
    ConfigurationError,
    CudaGraphUnsafeError,
    DistributedMismatchError,
    DistributedSelectionError,
    InvalidInputError,
    IsolatedWorkerError,
    IsolatedWorkerTimeoutError,
    KernelExecutionError,
    LayerZeroError,
    NoKernelFoundError,
    PolicyValidationError,
    SelectionTimeoutError,
    UnknownKernelError,
    UnknownOperationError,
)
from .core.knobs import configure_knobs, knobs, reset_knobs
from .core.knobs import get as get_knobs
from .core.quant_format import QuantFormat, QuantizedTensor
from .core.reasons import Reason, ReasonCode
from .core.report import SelectionReport
from .core.specs import ExecutionPlan, KernelSpec
from .graphs import GraphCheck, capture_selection, is_graph_safe, validate_graph_capture, warmup
from .ops import *  # noqa: F403 - every op's public function and the KV-cache helpers (ops.__all__, from the OpDefs)
from .ops import __all__ as _ops_all
from .planning import (
    DispatchTable,
    DryRunReport,
    Manifest,
    ReadinessReport,
    TableMismatchError,
    compile,
    dry_run,
    install_table,
    load_manifest,
    load_table,
    readiness_check,
    solve,
    uncompile,
    uninstall_table,
)
from .sampling_dist import sampling_probs, seeded_exponential, seeded_uniform
from .tokenization import Encoding, IncrementalDetokenizer, detokenize, tokenize


def doctor(*, print_report: bool = True) -> Any:
    """Inspect this machine and LayerZero's state: device, versions, backends (available or why not), kernels
    per op, config, policy, locks, health and PerfDB. Returns a :class:`~layerzero.diagnostics.DoctorReport`
    (``.to_dict()`` for JSON) and prints it as tables unless ``print_report=False``. Raises
    ``ConfigurationError`` for malformed ``LAYERZERO_*`` variables; an unusable PerfDB is reported, not
    raised."""
    from .diagnostics import run_doctor

    return run_doctor(print_report=print_report)


def patch_model(model: Any, **kwargs: Any) -> Any:
    """Route a Hugging Face Transformers model's attention, RMSNorm and RoPE through LayerZero; returns an
    undo handle. See :func:`layerzero.integrations.transformers.patch_model` (imports transformers lazily).
    A diffusers model (one holding diffusers ``Attention`` modules) goes to :func:`patch_diffusers` instead.
    Raises ``ConfigurationError`` for an unsupported ``model_type``, a model patched twice or a transformers
    release older than 4.56."""
    from .integrations.diffusers import is_diffusers_model

    if is_diffusers_model(model):
        return patch_diffusers(model, **kwargs)
    from .integrations.transformers import patch_model as _patch

    return _patch(model, **kwargs)


def patch_diffusers(model: Any, **kwargs: Any) -> Any:
    """Set :class:`~layerzero.integrations.diffusers.LayerZeroAttnProcessor` (``lz.attention``) on every
    diffusers ``Attention`` module of ``model`` (UNet, DiT, PixArt, ...); returns an undo handle. See
    :func:`layerzero.integrations.diffusers.patch_diffusers` (does not import diffusers). Raises
    ``ConfigurationError`` for a model without diffusers attention, one patched twice or a
    non-AttnProcessor2_0 processor (SD3/Flux joint attention)."""
    from .integrations.diffusers import patch_diffusers as _patch

    return _patch(model, **kwargs)


def register_hub_kernel(
    op: str, kernel_id: str, repo_id_or_path: Any, function_name: str, **kwargs: Any
) -> Any:
    """Register a Hugging Face kernel-hub function (``kernels`` package; a local kernel directory, or a repo
    id from the local HF cache: never downloads unless ``local_only=False``) as kernel ``kernel_id`` of ``op``
    through an adapter of the op's canonical arguments. See
    :func:`layerzero.integrations.hub_kernels.register_hub_kernel`. Raises ``BackendNotAvailableError`` when
    ``kernels`` or the kernel is missing locally, ``ConfigurationError`` for a bad function name, adapter or
    constraint."""
    from .integrations.hub_kernels import register_hub_kernel as _register

    return _register(op, kernel_id, repo_id_or_path, function_name, **kwargs)


def register_isolated_kernel(op: str, kernel_id: str, target: str, **kwargs: Any) -> Any:
    """Register ``target`` (``"module:function"``, imported only inside a worker process run by ``python=``,
    another venv's interpreter say) as kernel ``kernel_id`` of ``op``; tensors cross through shared memory,
    never pickle. Returns the registered :class:`KernelSpec`. Raises ``ConfigurationError`` (what
    ``lz.register_kernel`` raises, a non-CPU ``device_types``, conflicting backend options) and
    ``InvalidInputError`` (a bad ``timeout_s``); see :func:`layerzero.isolation.register` (options) and
    docs/isolation.md."""
    from .isolation import register

    return register(op, kernel_id, target, **kwargs)


def __getattr__(name: str) -> Any:
    """``lz.distributed`` (synchronized selection across ranks, :mod:`layerzero.distributed`), imported on
    first use so that ``import layerzero`` loads no ``torch.distributed`` machinery of its own;
    ``lz.isolation`` (worker processes for conflicting backends, :mod:`layerzero.isolation`) likewise."""
    if name in ("distributed", "isolation"):
        from importlib import import_module

        return import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # the op functions follow from ops.__all__ (derived from the OpDefs)
    "BackendNotAvailableError",
    "CacheCorruptionError",
    "ConfigurationError",
    "CudaGraphUnsafeError",
    "DistributedMismatchError",
    "DistributedSelectionError",
    "ExecutionPlan",
    "InvalidInputError",
    "KernelExecutionError",
    "KernelSpec",
    "LayerZeroError",
    "NoKernelFoundError",
    "PolicyValidationError",
    "Reason",
    "ReasonCode",
    "SelectionReport",
    "SelectionTimeoutError",
    "UnknownKernelError",
    "UnknownOperationError",
    "__version__",
    "configure",
    "disabled",
    "doctor",
    "explain",
    "get_config",
    "get_locks",
    "list_kernels",
    "load_capabilities",
    "load_config",
    "lock",
    "patch_diffusers",
    "patch_model",
    "prefer",
    "reload",
    "select",
    "trace",
    "TuneReport",
    "tune",
    "unlock",
    "validate",
    "which",
    "kernel",
    "register_kernel",
    "unregister_kernel",
    "IsolatedWorkerError",
    "IsolatedWorkerTimeoutError",
    "register_hub_kernel",
    "register_isolated_kernel",
    "GraphCheck",
    "capture_selection",
    "is_graph_safe",
    "validate_graph_capture",
    "warmup",
    "DispatchTable",
    "DryRunReport",
    "Manifest",
    "ReadinessReport",
    "TableMismatchError",
    "compile",
    "dry_run",
    "load_manifest",
    "load_table",
    "readiness_check",
    "solve",
    "uncompile",
    "install_table",
    "uninstall_table",
    "QuantFormat",
    "QuantizedTensor",
    "Encoding",
    "IncrementalDetokenizer",
    "detokenize",
    "tokenize",
    "BlockOp",
    "BlockPlan",
    "plan_block",
    "configure_knobs",
    "get_knobs",
    "knobs",
    "reset_knobs",
    "sampling_probs",
    "seeded_exponential",
    "seeded_uniform",
    *_ops_all,
]
