"""``lz.quantized_linear``: ``y = x @ dequantize(W_q).T + bias`` for a weight-only quantized weight (what
``lz.quantize`` returns for a ``[N, K]`` weight: int8 / fp8 per output channel or per tensor, int4 in groups
along K), dispatched to the best kernel: dequantize-then-GEMM (``torch_native``, the default until the fused
kernel is measured on a GPU), a fused low-bit GEMM that decodes the codes in registers and never writes the
float weight (``triton.quantized_linear``, opt in), or the float32 reference.

Why a fused kernel: decode's projections read their weight once per step, so a weight in 1 byte (int8, fp8) or
half a byte (int4) per element is read 2-4x faster than bf16, but only if nothing writes and re-reads a bf16
copy first (on the H200 the dequantize-then-GEMM engine ran 1.7-2.5x *slower* than bf16,
``benchmarks/results/engine/quantization_h200.md``). The approach is Marlin's / vLLM's weight-only GEMMs:
codes times scales in the GEMM's inner loop.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.errors import InvalidInputError
from layerzero.core.opdef import OpDef, define
from layerzero.core.quant_format import Granularity, QuantFormat, QuantizedTensor, format_granularity
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
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
)
from .linear import rows_key
from .quantization import DEQ, layout, prepare_dequantize, traceable

OP = "quantized_linear"
_Tensor = torch.Tensor
FORMATS = frozenset({QuantFormat.INT8, QuantFormat.FP8_E4M3, QuantFormat.FP8_E5M2, QuantFormat.INT4})
"""Weight formats taken: int8 / fp8 with one scale per output channel (``axis=0``) or per tensor; int4 in
groups along K (``group_size``; GPTQ / AWQ's layout as ``lz.quantize`` packs it)."""


class QuantLinearKey(NamedTuple):
    """The selection-cache key of one ``lz.quantized_linear`` call: rows M (exact up to 16, then the next
    power of two, as ``lz.linear``), in_features K and out_features N exact, the weight's format and
    granularity (``"channel"``, ``"tensor"`` or ``"group:<g>"``), autograd and determinism as ``lz.linear``'s
    key; ``capture``/``scope`` close every op's key (a scoped policy must not reuse an unscoped choice)."""

    op: str
    device: torch.device
    dtype: torch.dtype
    rows: int
    in_features: int
    out_features: int
    quant_format: str
    granularity: str
    has_bias: bool
    stride_last_1: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


class _Weight(NamedTuple):
    """What a valid weight's metadata (format, shape, dtype, axis, group_size) fixes: the layout its tensors
    must have (``(dtype, shape)`` of data, scale and zero point, None: must be None) and the key's weight
    fields."""

    data: tuple[torch.dtype, tuple[int, ...]]
    scale: tuple[torch.dtype, tuple[int, ...]]
    zero_point: tuple[torch.dtype, tuple[int, ...]] | None
    out_features: int
    in_features: int
    quant_format: str
    granularity: str


_WEIGHTS: dict[tuple[Any, ...], _Weight] = {}
"""Metadata that passed the full checks (:func:`_validate`), keyed by :func:`_meta_key`. Values only, never a
QuantizedTensor's identity: the engine builds a new one per call, and a tensor's shape can change in place
(``resize_``, ``set_``), so the tensors' dtypes, shapes and devices are checked again on every call
(:func:`_fast_weight`). Cleared when it reaches :data:`_MAX_WEIGHTS` entries (a model has a handful)."""
_MAX_WEIGHTS = 256


def _meta_key(qt: Any) -> tuple[Any, ...] | None:
    """``qt``'s metadata as a :data:`_WEIGHTS` key, or None (not memoized) unless every field has exactly the
    type ``lz.quantize`` stores: equal values of other types hash alike (``"int8" == QuantFormat.INT8``,
    ``False == 0``, ``numpy.int64(7) == 7``, ``32.0 == 32``) but the full checks refuse them; and ``qt`` must
    be a :class:`QuantizedTensor` of exactly that type (a subclass could override a field's attribute)."""
    if type(qt) is not QuantizedTensor:
        return None
    _, _, _, _, fmt, shape, dtype, axis, group = qt
    if (
        type(fmt) is QuantFormat
        and (type(shape) is torch.Size or type(shape) is tuple)
        and len(shape) == 2
        and type(shape[0]) is int
        and type(shape[1]) is int
        and type(dtype) is torch.dtype
        and (axis is None or type(axis) is int)
        and (group is None or type(group) is int)
    ):
        return fmt, shape, dtype, axis, group
    return None


def _fast_weight(x: Any, qt: Any, bias: Any) -> _Weight | None:
    """The common case without the full checks: ``qt``'s metadata already passed them (:data:`_WEIGHTS`) and
    its tensors, x and bias have the dtypes, shapes and devices that metadata fixes. None: anything else (then
    :func:`_validate` raises the error that says what is wrong, or finds the inputs valid after all). Returns
    a weight only where :func:`_validate` would pass: every one of its checks is either fixed by the memoized
    metadata or repeated here."""
    if not isinstance(x, _Tensor):
        return None
    key = _meta_key(qt)
    w = None if key is None else _WEIGHTS.get(key)
    if w is None:
        return None
    data, scale, zero, global_scale, _, _, dtype, _, _ = qt
    if not (
        isinstance(data, _Tensor)
        and data.dtype is w.data[0]
        and data.shape == w.data[1]
        and isinstance(scale, _Tensor)
        and scale.dtype is w.scale[0]
        and scale.shape == w.scale[1]
        and global_scale is None
        and x.dtype is dtype
        and x.dim() >= 1
        and x.shape[-1] == w.in_features
    ):
        return None
    dev = data.device
    if scale.device != dev or x.device != dev:
        return None
    if w.zero_point is None:
        if zero is not None:
            return None
    elif not (
        isinstance(zero, _Tensor)
        and zero.dtype is w.zero_point[0]
        and zero.shape == w.zero_point[1]
        and zero.device == dev
    ):
        return None
    if bias is not None and not (
        isinstance(bias, _Tensor)
        and bias.dtype is dtype
        and bias.dim() == 1
        and bias.shape[0] == w.out_features
        and bias.device == dev
    ):
        return None
    return w


def _validate(x: Any, qt: Any, bias: Any) -> _Weight:
    """The full checks, in order: raise the typed error that says what is wrong; else return the weight's
    :class:`_Weight` (memoized when :func:`_meta_key` takes ``qt``).

    Raises:
        InvalidInputError: see :func:`quantized_linear`.
    """
    check_tensor(OP, "x", x)  # a float tensor
    if x.dim() == 0:
        raise fail(OP, "x rank", ">= 1 dims ([..., K])", "a 0-dim tensor")
    try:
        prepare_dequantize(qt)  # the QuantizedTensor's own consistency
    except InvalidInputError as exc:  # the same message, under this op's name
        raise InvalidInputError(str(exc).replace(f"lz.{DEQ}:", f"lz.{OP}:", 1)) from None
    if len(qt.shape) != 2:
        raise fail(OP, "qt.shape", "a quantized weight [N, K] (out_features, in_features)", list(qt.shape))
    n, k = qt.shape
    if qt.format not in FORMATS:
        raise fail(
            OP,
            "qt.format",
            f"one of {sorted(f.value for f in FORMATS)}",
            qt.format.value,
            "Dequantize other formats first: lz.linear(x, lz.dequantize(qt), bias).",
        )
    gran = format_granularity(qt.format, qt.axis, qt.group_size)
    if qt.format is not QuantFormat.INT4 and not (gran is Granularity.TENSOR or qt.axis == 0):
        raise fail(
            OP,
            f"{qt.format.value} scale granularity",
            "one scale per output channel (axis=0) or per tensor",
            f"{gran.value} (axis={qt.axis!r}, group_size={qt.group_size!r})",
            "Quantize the weight with lz.quantize(w, fmt, axis=0).",
        )
    if x.shape[-1] != k:
        raise fail(
            OP,
            "x.shape[-1] (in_features K)",
            f"{k} (qt.shape[1], the weight is [N, K] = {[n, k]})",
            x.shape[-1],
        )
    if x.device != qt.data.device:
        raise fail(OP, "devices", f"x on {qt.data.device} like the quantized weight", x.device)
    if qt.dtype != x.dtype:
        raise fail(
            OP,
            "qt.dtype (the weight's float dtype)",
            f"x's dtype {x.dtype}",
            qt.dtype,
            "Quantize the weight from the model dtype the activations have.",
        )
    if bias is not None:
        check_tensor(OP, "bias", bias, 1)
        check_same(OP, "x", x, "bias", bias)
        if bias.shape[0] != n:
            raise fail(OP, "bias shape", f"[N] = [{n}]", list(bias.shape))
    data, scale, zero, _ = layout(qt.format, (n, k), qt.axis, qt.group_size)
    w = _Weight(
        data,
        scale,
        zero,
        n,
        k,
        qt.format.value,
        f"group:{qt.group_size}" if gran is Granularity.GROUP else gran.value,
    )
    key = _meta_key(qt)
    if key is not None:
        if len(_WEIGHTS) >= _MAX_WEIGHTS:
            _WEIGHTS.clear()
        _WEIGHTS[key] = w
    return w


def prepare(
    x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None
) -> tuple[QuantLinearKey, tuple[Any, ...]]:
    """Validate ``lz.quantized_linear`` inputs; return (cache key, canonical kernel args ``(x, qt, bias)``).

    Raises:
        InvalidInputError: see :func:`quantized_linear`.
    """
    key, args = _prepare(x, qt, bias)
    return QuantLinearKey(*key), args


def _prepare(x: Any, qt: Any, bias: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """:func:`prepare` on the hot path: the key is the plain tuple of the :class:`QuantLinearKey` fields
    (equal to it and hashed alike; dispatch names it on a miss). A weight's metadata is checked once per
    distinct metadata (:data:`_WEIGHTS`); its tensors, x and bias on every call (:func:`_fast_weight`);
    anything unexpected takes the full checks (:func:`_validate`)."""
    w = _fast_weight(x, qt, bias) or _validate(x, qt, bias)
    return key_of(OP, x, qt, bias, w), (x, qt, bias)


def key_of(
    op: str, x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None, w: _Weight
) -> tuple[Any, ...]:
    """The :class:`QuantLinearKey` fields (a plain tuple) of a validated call of ``op``
    (``lz.quantized_linear`` or ``lz.fp8_linear``) with weight metadata ``w``."""
    k = w.in_features
    stride = x.stride(-1) == 1 and qt.data.stride(-1) == 1 and (bias is None or bias.stride(0) == 1)
    grad = is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    layers = scope_layers()
    return (
        op,
        x.device,
        x.dtype,
        rows_key(x.numel() // k),
        k,
        w.out_features,
        w.quant_format,
        w.granularity,
        bias is not None,
        stride,
        grad,
        deterministic_enabled(),
        x.is_cuda and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )


def context(key: QuantLinearKey) -> SelectionContext:
    """The :class:`SelectionContext` of a quantized-linear key (``lz.quantized_linear``'s or
    ``lz.fp8_linear``'s): ``batch`` = rows M, ``hidden_size`` = K, ``intermediate_size`` = N, ``quant_format``
    / ``quant_granularity`` the weight's."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.rows,
        hidden_size=key.in_features,
        intermediate_size=key.out_features,
        has_bias=key.has_bias,
        stride_last_1=key.stride_last_1,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
        quant_format=key.quant_format,
        quant_granularity=key.granularity,
    )


SPEC = OperationSpec(
    OP,
    "weight-only quantized linear y = x @ dequantize(W_q).T + bias (int8, fp8, int4)",
    ("x", "qt", "bias"),
    "reference.quantized_linear",
    key_type=QuantLinearKey,
)


def quantized_linear(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only quantized linear projection ``y = x @ dequantize(qt).T + bias`` (``F.linear`` semantics
    with a weight that ``lz.quantize`` stored in int8, fp8 or int4).

    Shapes (M rows = the product of x's leading dims, K in_features, N out_features): ``x`` ``[..., K]``;
    ``qt`` a :class:`~layerzero.QuantizedTensor` of a ``[N, K]`` weight: ``"int8"`` / ``"fp8_e4m3"`` /
    ``"fp8_e5m2"`` with ``axis=0`` (scale ``[N, 1]`` float32) or per tensor (scale ``[]``), or ``"int4"``
    (codes uint8 ``[N, K/2]``, scale float32 and zero point uint8 ``[N, K/g]``, g = ``qt.group_size``);
    ``bias`` ``[N]`` or None -> out ``[..., N]`` in x's dtype, a new tensor. ``qt.dtype`` (the weight's float
    dtype) must be x's dtype.

    Numerics: every kernel multiplies codes by their scales exactly in float32 or applies the scale to the
    float32 accumulator (per channel, per group), accumulates in float32 and rounds once to x's dtype; the
    reference keeps the dequantized weight in float32 (no rounding of the weight to x's dtype, which
    dequantize-then-GEMM does), so kernels agree within x's dtype's tolerance (fp16/bf16 ~1e-2 relative on
    large K).

    Kernels: ``torch_native.quantized_linear`` (``F.linear`` on ``lz.dequantize``'s weight: cuBLAS / oneDNN;
    the default), ``triton.quantized_linear`` (CUDA, fp16/bf16: the fused low-bit GEMM, codes decoded in
    registers; opt in with ``lz.lock("quantized_linear",
    "triton.quantized_linear")`` until measured on a GPU), ``reference.quantized_linear`` (float32 math, the
    oracle).

    Raises:
        InvalidInputError: x not a float tensor or 0-dim, ``qt`` not a consistent QuantizedTensor of a 2-D
            weight, a format other than int8 / fp8 / int4 or an int8 / fp8 scale that is not per channel
            (axis 0) or per tensor, ``x.shape[-1] != K``, ``qt.dtype`` or device not x's, bias not ``[N]``
            like x.
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> w = torch.tensor([[127.0, -127.0], [0.0, 254.0]])  # exact in int8 (scales 1 and 2)
    >>> lz.quantized_linear(torch.tensor([[1.0, 2.0]]), lz.quantize(w, "int8", axis=0)).tolist()
    [[-127.0, 508.0]]
    """
    if (is_dynamo_compiling() or is_exporting()) and traceable(qt) and inference_only(x, bias):
        return traced("quantized_linear")(x, qt, bias)
    key, args = _prepare(x, qt, bias)
    return RUNTIME.run(key, context, args)


__all__ = ["FORMATS", "OP", "QuantLinearKey", "SPEC", "context", "prepare", "quantized_linear"]


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(SPEC, quantized_linear, prepare, context, custom_ops=("quantized_linear",)),
)
