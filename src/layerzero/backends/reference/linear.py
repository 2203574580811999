"""Reference ``lz.linear``: the product in float32 (float64 for float64 inputs), rounded once, written for
clarity (the oracle)."""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``: x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]`` in x's
    dtype, accumulated in float32 (float64 for float64) and rounded once, as cuBLAS does."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.matmul(x.to(acc), weight.to(acc).t())
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference ``lz.rms_norm_linear``: ``reference.rms_norm`` (``cast_before_weight=True``, the residual sum
    rounded to x's dtype) then :func:`linear`; returns y, or ``(y, x + residual)`` with a residual."""
    from .norms import rms_norm

    if residual is None:
        return linear(rms_norm(x, norm_weight, eps, cast_before_weight=True), weight, bias)
    h_norm, h = rms_norm(x, norm_weight, eps, residual, cast_before_weight=True)
    return linear(h_norm, weight, bias), h


def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Reference ``lz.swiglu_linear``: ``reference.swiglu`` (rounded as Hugging Face ``LlamaMLP`` rounds) then
    :func:`linear`."""
    from .swiglu import swiglu

    return linear(swiglu(gate, up), weight, bias)


def quantized_linear(x: torch.Tensor, qt, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001 - QuantizedTensor
    """Reference ``lz.quantized_linear``: the weight decoded in float32 (float64 for float64 x), never rounded
    to x's dtype (int8 codes and fp8 values times their per-channel or per-tensor scale; int4 nibbles, low
    first, minus the group's zero point times its scale), then :func:`linear`'s product, rounded once to x's
    dtype."""
    from .quantize import unpack_nibbles

    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n, k = qt.shape
    if qt.format.value == "int4":
        g = qt.group_size
        codes = unpack_nibbles(qt.data).to(acc)
        weight = (codes - qt.zero_point.to(acc).repeat_interleave(g, dim=1)) * qt.scale.to(
            acc
        ).repeat_interleave(g, dim=1)
    else:
        weight = qt.data.to(acc) * qt.scale.to(acc)  # scale [N, 1] or []: broadcasts
    y = torch.matmul(x.to(acc), weight.t())
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def fp8_linear(x: torch.Tensor, qt, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001 - QuantizedTensor
    """Reference ``lz.fp8_linear``: x quantized per row by ``reference.quantize`` (fp8 e4m3, ``axis=0`` of the
    ``[M, K]`` rows), the e4m3 codes' products summed in float64 (exact products, a float64 sum), times the
    row's and the weight's scales and plus bias in float64, rounded once to x's dtype."""
    from layerzero.core.quant_format import QuantFormat

    from .quantize import quantize

    k, n = x.shape[-1], qt.shape[0]
    xq = quantize(x.reshape(-1, k), QuantFormat.FP8_E4M3, 0, None)
    y = (xq.data.to(torch.float64) @ qt.data.to(torch.float64).t()) * xq.scale.to(torch.float64)
    y = y * qt.scale.to(torch.float64).reshape(1, -1)  # per channel [N, 1] -> [1, N]; per tensor [] -> [1, 1]
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
