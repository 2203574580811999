"""``lz.fp8_linear``: W8A8 fp8 linear ``y = (e4m3(x / s_x) @ W_q.T) * s_x * s_w + bias``: the activation
quantized to fp8 e4m3 per token on the fly, the weight an fp8 e4m3 ``lz.quantize`` result, one fp8 x fp8 GEMM
with float32 accumulation (vLLM's dynamic-per-token ``Fp8LinearOp`` / ``cutlass_scaled_mm``;
``torch._scaled_mm`` with row-wise scales). Unlike ``lz.quantized_linear`` (weight-only: x enters the GEMM in
full precision) the activation's rounding is part of the contract, so the two ops are separate and never
substitute for each other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.errors import InvalidInputError
from layerzero.core.opdef import OpDef, define
from layerzero.core.quant_format import QuantFormat, QuantizedTensor
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from . import quantized_linear as _ql
from ._common import fail, inference_only, is_grad_enabled
from .quantization import traceable

OP = "fp8_linear"


def _weight(x: Any, qt: Any, bias: Any) -> _ql._Weight:
    """``lz.quantized_linear``'s checks under this op's name, then the W8A8 ones (an fp8 e4m3 weight)."""
    w = _ql._fast_weight(x, qt, bias)
    if w is None:
        try:
            w = _ql._validate(x, qt, bias)
        except InvalidInputError as exc:  # the same message, under this op's name
            raise InvalidInputError(str(exc).replace(f"lz.{_ql.OP}:", f"lz.{OP}:", 1)) from None
    if is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        raise fail(
            OP,
            "x / bias requires_grad",
            "False (or torch.no_grad()): the op is inference only, no gradient "
            "flows through the activation's fp8 rounding",
            True,
            "Call it under torch.no_grad(), or use lz.quantized_linear (weight-only, differentiable in x).",
        )
    if w.quant_format != QuantFormat.FP8_E4M3.value:
        raise fail(
            OP,
            "qt.format",
            "fp8_e4m3 (the W8A8 GEMM multiplies e4m3 codes)",
            w.quant_format,
            "Quantize the weight with lz.quantize(w, 'fp8_e4m3', axis=0), or use lz.quantized_linear "
            "(weight-only) for other formats.",
        )
    return w


def prepare(
    x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None
) -> tuple[_ql.QuantLinearKey, tuple[Any, ...]]:
    """Validate ``lz.fp8_linear`` inputs; return (cache key, canonical kernel args ``(x, qt, bias)``). The key
    is ``lz.quantized_linear``'s (:class:`~.quantized_linear.QuantLinearKey`) with this op's name.

    Raises:
        InvalidInputError: see :func:`fp8_linear`.
    """
    key, args = _prepare(x, qt, bias)
    return _ql.QuantLinearKey(*key), args


def _prepare(x: Any, qt: Any, bias: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """:func:`prepare` on the hot path (the key as a plain tuple, as ``lz.quantized_linear``'s)."""
    return _ql.key_of(OP, x, qt, bias, _weight(x, qt, bias)), (x, qt, bias)


context = _ql.context

SPEC = OperationSpec(
    OP,
    "W8A8 fp8 linear: x quantized to e4m3 per token, e4m3 weight, float32 accumulation",
    ("x", "qt", "bias"),
    "reference.fp8_linear",
    key_type=_ql.QuantLinearKey,
)


def fp8_linear(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 fp8 linear projection: each row of x quantized to fp8 e4m3 with its own scale, multiplied with an
    fp8 e4m3 weight in one fp8 GEMM (float32 accumulation), both scales applied to the accumulator, bias
    added, one rounding to x's dtype. vLLM's dynamic per-token fp8 linear (``Fp8LinearOp``); Micikevicius et
    al. 2022, "FP8 Formats for Deep Learning" (E4M3).

    Shapes (M rows = the product of x's leading dims, K in_features, N out_features): ``x`` ``[..., K]``
    float16 / bfloat16 / float32 / float64; ``qt`` ``lz.quantize(w, "fp8_e4m3", axis=0)`` (scale ``[N, 1]``
    float32) or per tensor (scale ``[]``) of a ``[N, K]`` weight whose ``qt.dtype`` is x's dtype; ``bias``
    ``[N]`` like x or None -> ``[..., N]`` in x's dtype, a new tensor.

    Numerics, every kernel: the rows quantized as ``lz.quantize(x2d, "fp8_e4m3", axis=0)`` does, i.e. per row
    m, in float32, ``s_x[m] = max(amax(|x[m]|) / 448, 2^-126)`` and ``q[m] = e4m3(clamp(x[m] / s_x[m], -448,
    448))`` (round to nearest even); ``y[m, n] = (sum_k q[m, k] * w_q[n, k]) * s_x[m] * s_w[n] + bias[n]``,
    rounded once to x's dtype. The activation rounding (3 mantissa bits, ~3% of a value at most) is part of
    the result: compare against ``lz.quantized_linear`` only with that tolerance. Non-finite x values give
    non-finite rows (not checked).

    Kernels: ``torch_native.fp8_linear`` (``torch._scaled_mm`` with row-wise scales: CPU, and CUDA SM >= 9.0
    in bfloat16 with K and N multiples of 16; the default where it applies), ``reference.fp8_linear`` (the
    codes' products summed in float64, the oracle).

    Raises:
        InvalidInputError: what ``lz.quantized_linear`` raises for x, qt and bias (named ``lz.fp8_linear``), a
            weight format other than ``fp8_e4m3``, x or bias requiring grad with autograd on (inference only).
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> w = torch.tensor([[1.0, -2.0], [0.5, 4.0]])  # codes 224, -448 and 56, 448 (scales 2 / 448, 4 / 448)
    >>> y = lz.fp8_linear(torch.tensor([[3.0, 0.75]]), lz.quantize(w, "fp8_e4m3", axis=0))  # codes 448, 112
    >>> [round(v, 4) for v in y[0].tolist()]
    [1.5, 4.5]
    """
    if (is_dynamo_compiling() or is_exporting()) and traceable(qt) and inference_only(x, bias):
        return traced("fp8_linear")(x, qt, bias)
    key, args = _prepare(x, qt, bias)
    return RUNTIME.run(key, context, args)


__all__ = ["OP", "SPEC", "context", "fp8_linear", "prepare"]


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(SPEC, fp8_linear, prepare, context, custom_ops=("fp8_linear",)),
)
