"""``lz.rms_norm_linear``: RMSNorm (optionally after adding the residual) followed by a linear projection, in
one call: a pre-norm transformer's ``input_layernorm -> qkv_proj`` and
``post_attention_layernorm -> gate_up_proj``.

Why one op: in a decode step the norm is a kernel of its own whose output only the next GEMM reads; fused into
the GEMM's prologue (``triton.rms_norm_linear``) a decode layer runs two kernels fewer, and a CUDA graph's
kernels are each a few µs of mostly fixed latency at batch 1 (``benchmarks/results/engine/h200/``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import MISS
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    check_eps,
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    fail,
    inference_only,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
    tensors_exact_key,
)
from .linear import rows_key, validate

OP = "rms_norm_linear"


class RmsNormLinearKey(NamedTuple):
    """The selection-cache key of one ``lz.rms_norm_linear`` call: as ``lz.linear``'s (``rows`` exact up to
    16, ``in_features`` K, ``out_features`` N), plus ``fused_residual``."""

    op: str
    device: torch.device
    dtype: torch.dtype
    rows: int
    in_features: int
    out_features: int
    has_bias: bool
    fused_residual: bool
    stride_last_1: bool
    contiguous: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def prepare(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.rms_norm_linear`` inputs; return (cache key, canonical kernel args
    ``(x, norm_weight, weight, bias, residual, eps)``).

    Raises:
        InvalidInputError: see :func:`rms_norm_linear`.
    """
    validate(x, weight, bias, OP)
    n, k = weight.shape
    check_tensor(OP, "norm_weight", norm_weight, 1)
    check_same(OP, "x", x, "norm_weight", norm_weight)
    if norm_weight.shape[0] != k:
        raise fail(OP, "norm_weight shape", f"[K] = [{k}] (x.shape[-1])", list(norm_weight.shape))
    if residual is not None:
        check_tensor(OP, "residual", residual)
        check_same(OP, "x", x, "residual", residual)
        if residual.shape != x.shape:
            raise fail(OP, "residual shape", f"x's shape {list(x.shape)}", list(residual.shape))
    eps = check_eps(OP, eps)
    tensors = [t for t in (x, norm_weight, weight, bias, residual) if t is not None]
    contiguous = all(t.is_contiguous() for t in tensors)
    stride = contiguous or all(t.stride(-1) == 1 for t in tensors)
    grad = is_grad_enabled() and any(t.requires_grad for t in tensors)
    layers = scope_layers()
    key = RmsNormLinearKey(
        OP,
        x.device,
        x.dtype,
        rows_key(x.numel() // k),
        k,
        n,
        bias is not None,
        residual is not None,
        stride,
        contiguous,
        grad,
        deterministic_enabled(),
        x.is_cuda and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )
    return key, (x, norm_weight, weight, bias, residual, eps)


def context(key: RmsNormLinearKey) -> SelectionContext:
    """The :class:`SelectionContext` of a cache key: ``batch`` = rows M, ``hidden_size`` = K,
    ``intermediate_size`` = N, ``has_bias``, ``fused_residual``."""
    return SelectionContext(
        op=OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.rows,
        hidden_size=key.in_features,
        intermediate_size=key.out_features,
        has_bias=key.has_bias,
        fused_residual=key.fused_residual,
        stride_last_1=key.stride_last_1,
        contiguous=key.contiguous,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


SPEC = OperationSpec(
    OP,
    "RMSNorm (+ fused residual add) then a linear projection (pre-norm block's norm -> GEMM)",
    ("x", "norm_weight", "weight", "bias", "residual"),
    "reference.rms_norm_linear",
    key_type=RmsNormLinearKey,
)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``lz.linear(lz.rms_norm(x, norm_weight, eps), weight, bias)`` in one call (RMSNorm: Zhang & Sennrich
    2019); with ``residual``, ``h = x + residual`` is normalized instead and ``(y, h)`` returned, as
    ``lz.rms_norm(x, norm_weight, eps, residual=residual)`` returns the new residual stream (vLLM's fused
    add + RMSNorm, then the projection).

    Shapes (M rows = the product of x's leading dims, K hidden size, N out_features): ``x`` ``[..., K]``,
    ``norm_weight`` ``[K]``, ``weight`` ``[N, K]`` (``torch.nn.Linear``'s layout), ``bias`` ``[N]`` or None,
    ``residual`` like x or None -> y ``[..., N]`` (and h ``[..., K]``), new tensors in x's dtype. All inputs
    share one dtype (float32/float64/float16/bfloat16) and device. ``eps`` (unitless, > 0) is added to the
    mean square.

    Rounding: h rounded to x's dtype (a model's residual stream) and the normalized row rounded to x's dtype
    before the projection, as the two-op form stores it; ``reference`` and ``triton`` round the normalized row
    before the weight multiply too (``reference.rms_norm(cast_before_weight=True)``, Hugging Face
    ``LlamaRMSNorm``), ``torch_native`` is ``F.rms_norm`` then ``F.linear`` bit for bit. The projection
    accumulates in float32 (float64 for float64) and rounds once.

    Kernels: ``triton.rms_norm_linear`` (CUDA fp16/bf16, decode rows: 1, 2 for N <= 4096, up to 4 for N <=
    2048; K <= 4096; the norm in the prologue of ``triton.gemv``'s prefetch kernel: one launch instead of
    two), ``torch_native.rms_norm_linear`` (the norm, then ``F.linear``; the default elsewhere),
    ``reference.rms_norm_linear`` (float32 math, the oracle).

    Raises:
        InvalidInputError: inputs that are not float tensors, x 0-dim, weight not ``[N, K]`` with N, K >= 1,
            ``x.shape[-1] != K``, norm_weight not ``[K]``, bias not ``[N]``, residual not x's shape, dtypes or
            devices that differ, eps not a finite float > 0.
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> y, h = lz.rms_norm_linear(torch.tensor([[1.0, 1.0]]), torch.ones(2), torch.eye(2),
    ...                           eps=1e-12, residual=torch.tensor([[2.0, -4.0]]))
    >>> h.tolist(), [round(v, 4) for v in y[0].tolist()]  # h = [3, -3], rms 3: normalized to [1, -1]
    ([[3.0, -3.0]], [1.0, -1.0])
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(x, norm_weight, weight, bias, residual):
        return traced("rms_norm_linear")(x, norm_weight, weight, bias, eps, residual)
    args = (x, norm_weight, weight, bias, residual, eps)
    hot_key = _exact_key(*args)
    if hot_key is not None:
        out = RUNTIME.run_hot(hot_key, args)
        if out is not MISS:
            return out
    key, args = prepare(x, norm_weight, weight, bias, eps=eps, residual=residual)
    return RUNTIME.run(key, context, args, hot_key)


def _exact_key(
    x: Any, norm_weight: Any, weight: Any, bias: Any, residual: Any, eps: Any
) -> tuple[Any, ...] | None:
    """The exact key of a call (``Runtime.run_hot``, as ``lz.linear``'s): every input's dtype, shape and
    strides (None for an absent bias / residual), ``eps`` as given, the device and the per-call flags
    (:func:`~._common.tensors_exact_key`). Only calls that passed every check of :func:`prepare` file it, and
    every fact those checks read is in it, so a hit skips them. None (the full path) for anything but plain
    tensors on one CPU or CUDA device and a float eps."""
    if eps.__class__ is not float:
        return None
    return tensors_exact_key(OP, (x, norm_weight, weight, bias, residual), eps)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        rms_norm_linear,
        prepare,
        context,
        kernel_args=("x", "norm_weight", "weight", "bias", "residual", "eps"),
        custom_ops=("rms_norm_linear",),
    ),
)
