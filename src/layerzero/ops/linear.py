"""``lz.linear``: ``y = x @ weight.T + bias`` (``torch.nn.functional.linear`` semantics), dispatched to the
best kernel for these inputs: cuBLAS (through torch) by default; a Triton skinny-GEMM kernel for decode-sized
inputs (1-8 rows, where cuBLAS's tile choice reads some weights at a fraction of the memory bandwidth) is
there to opt in to."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import MISS
from layerzero.core.observers import OBSERVERS
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    FLOAT_DTYPES,
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    exact_device,
    fail,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
)

OP = "linear"
EXACT_ROWS = 16
"""Row counts up to this are exact in the cache key (decode batches: the skinny-GEMM kernels are chosen per
M); larger ones are bucketed to the next power of two."""


class LinearKey(NamedTuple):
    """The selection-cache key of one ``lz.linear`` call: ``rows`` M (exact up to :data:`EXACT_ROWS`, then the
    next power of two), ``in_features`` K and ``out_features`` N exact, ``has_bias``; ``capture``/``scope``
    close every op's key (see ``ops.attention.AttentionKey``)."""

    op: str
    device: torch.device
    dtype: torch.dtype
    rows: int
    in_features: int
    out_features: int
    has_bias: bool
    stride_last_1: bool
    contiguous: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def _fast_ok(x: Any, weight: Any, bias: Any) -> bool:
    """The common case in a few attribute reads (no bias): float x ``[..., K]`` and weight ``[N, K]`` of one
    dtype and device, K and N >= 1."""
    try:
        ws = weight.shape
        return (
            bias is None
            and x.dtype in FLOAT_DTYPES
            and len(ws) == 2
            and ws[0] > 0
            and ws[1] > 0
            and x.dim() >= 1
            and x.shape[-1] == ws[1]
            and weight.dtype == x.dtype
            and weight.device == x.device
        )
    except AttributeError:
        return False


def validate(x: Any, weight: Any, bias: Any, op: str = OP, x_name: str = "x") -> None:
    """The slow path: raise the typed error that says what is wrong (``op``'s name and its input's ``x_name``
    in the message: the fused ops that end in a projection check theirs with it).

    Raises:
        InvalidInputError: see :func:`linear`.
    """
    check_tensor(op, x_name, x)
    check_tensor(op, "weight", weight, 2)
    if x.dim() == 0:
        raise fail(op, f"{x_name} rank", ">= 1 dims ([..., K])", "a 0-dim tensor")
    check_same(op, x_name, x, "weight", weight)
    n, k = weight.shape
    if n == 0 or k == 0:
        raise fail(
            op,
            "weight shape",
            "[N, K] with N >= 1 and K >= 1 (out_features, in_features)",
            list(weight.shape),
        )
    if x.shape[-1] != k:
        raise fail(
            op,
            f"{x_name}.shape[-1] (in_features K)",
            f"{k} (weight.shape[1], weight is [N, K] = {list(weight.shape)})",
            x.shape[-1],
            "weight is [out_features, in_features], as torch.nn.Linear stores it.",
        )
    if bias is not None:
        check_tensor(op, "bias", bias, 1)
        check_same(op, x_name, x, "bias", bias)
        if bias.shape[0] != n:
            raise fail(op, "bias shape", f"[N] = [{n}] (weight.shape[0])", list(bias.shape))


def rows_key(m: int) -> int:
    """The key's row count: exact up to :data:`EXACT_ROWS`, then the next power of two."""
    return m if m <= EXACT_ROWS else 1 << (m - 1).bit_length()


def prepare(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    op: str = OP,
    x_name: str = "x",
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.linear`` inputs; return (cache key, canonical kernel args ``(x, weight, bias)``). ``op``
    / ``x_name``: a fused op ending in this projection (its key's op, its name in errors).

    Raises:
        InvalidInputError: see :func:`linear`.
    """
    if not _fast_ok(x, weight, bias):
        validate(x, weight, bias, op, x_name)
    n, k = weight.shape
    m = x.numel() // k
    contiguous = x.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous())
    stride = contiguous or (
        x.stride(-1) == 1 and weight.stride(-1) == 1 and (bias is None or bias.stride(0) == 1)
    )
    grad = is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    layers = scope_layers()
    key = LinearKey(
        op,
        x.device,
        x.dtype,
        rows_key(m),
        k,
        n,
        bias is not None,
        stride,
        contiguous,
        grad,
        deterministic_enabled(),
        x.is_cuda and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )
    return key, (x, weight, bias)


def context(key: LinearKey) -> SelectionContext:
    """The :class:`SelectionContext` of a linear cache key: ``batch`` = rows M (as the key holds it),
    ``hidden_size`` = in_features K, ``intermediate_size`` = out_features N, ``has_bias``."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.rows,
        hidden_size=key.in_features,
        intermediate_size=key.out_features,
        has_bias=key.has_bias,
        stride_last_1=key.stride_last_1,
        contiguous=key.contiguous,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


SPEC = OperationSpec(
    OP,
    "linear projection y = x @ weight.T + bias (F.linear semantics)",
    ("x", "weight", "bias"),
    "reference.linear",
    key_type=LinearKey,
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Linear projection ``y = x @ weight.T + bias``, as ``torch.nn.functional.linear`` (every projection of a
    transformer: QKV, output, gate/up, down, LM head).

    Shapes (M rows = the product of x's leading dims, K in_features, N out_features): ``x`` ``[..., K]``,
    ``weight`` ``[N, K]`` (``torch.nn.Linear``'s layout), ``bias`` ``[N]`` or None -> out ``[..., N]``, a new
    tensor. dtype: float32/float64/float16/bfloat16, all inputs alike; the output in that dtype. Every kernel
    accumulates in float32 or wider (float64 for float64) and rounds once to the output dtype, as cuBLAS does;
    results of two kernels differ by accumulation order only (fp16/bf16 ~1e-2 relative on large K, float32
    ~1e-5).

    Kernels: ``triton.gemv`` (CUDA, fp16/bf16, 1-8 rows: decode's projections; the default there, faster in
    isolation on every measured shape, ``benchmarks/results/in_graph_h200.md``, and in the engine, see
    ``backends/triton/gemv.py``), ``torch_native.linear`` (``F.linear``: cuBLAS / oneDNN; the default
    elsewhere), ``reference.linear`` (float32 math, the oracle).

    Raises:
        InvalidInputError: x, weight or bias not tensors or not float, a 0-dim x, weight not 2-D ``[N, K]``
            with N, K >= 1, ``x.shape[-1] != K``, bias not ``[N]``, or dtypes/devices that differ.
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> lz.linear(torch.ones(2, 3), torch.ones(4, 3), torch.arange(4.0)).tolist()
    [[3.0, 4.0, 5.0, 6.0], [3.0, 4.0, 5.0, 6.0]]
    """
    if (
        is_dynamo_compiling() or is_exporting()
    ):  # one custom-op node (custom_ops/_ops.py; with a backward formula)
        return traced("linear")(x, weight, bias)
    hot_key = _exact_key(x, weight, bias)
    if hot_key is not None:
        if OBSERVERS.none:  # Runtime.run_hot inlined (core/observers.py says when that is allowed and why)
            plan = RUNTIME.cache.hot.get(hot_key)
            if plan is not None:
                try:
                    return plan.call(x, weight, bias)
                except Exception as exc:  # noqa: BLE001 - recorded, then retried or re-raised as run_hot does
                    return RUNTIME.hot_failure(plan, exc, (x, weight, bias))
        else:
            out = RUNTIME.run_hot(hot_key, (x, weight, bias))
            if out is not MISS:
                return out
    key, args = prepare(x, weight, bias)
    return RUNTIME.run(key, context, args, hot_key)


_TENSOR = torch.Tensor


def _exact_key(x: Any, weight: Any, bias: Any) -> tuple[Any, ...] | None:
    """The exact key of an ``lz.linear`` call (``Runtime.run_hot``, as ``lz.rms_norm``'s): x's and weight's
    dtypes, shapes and strides, the bias's (or None), the device as -1 (CPU) or the CUDA index, the per-call
    flags. Only calls that passed every check of :func:`prepare` file it (``Runtime.run``), and every fact
    those checks read is in it, so a hit skips the checks and the key build. None (the full path) for anything
    but plain tensors on one CPU or CUDA device."""
    if (
        x.__class__ is not _TENSOR
        or weight.__class__ is not _TENSOR
        or (bias is not None and bias.__class__ is not _TENSOR)
    ):
        return None
    dev = exact_device(x, weight, bias)
    if dev is None:
        return None
    layers = scope_layers()
    if bias is None:
        b, grad = None, is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    else:
        b = (bias.dtype, bias.shape, bias.stride())
        grad = is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad)
    return (
        "linear",
        dev,
        x.dtype,
        weight.dtype,
        x.shape,
        x.stride(),
        weight.shape,
        weight.stride(),
        b,
        grad,
        deterministic_enabled(),
        dev >= 0 and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(SPEC, linear, prepare, context, custom_ops=("linear",)),
)
