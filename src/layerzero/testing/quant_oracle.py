"""A float64 oracle for quantized weights in tests: the ``[N, K]`` weight a
:class:`~layerzero.QuantizedTensor` stands for, decoded here by hand (int8 codes and fp8 values times their
per-channel or per-tensor scale; int4 nibbles, low first, minus the group's zero point times its scale),
independently of LayerZero's quantize, dequantize and quantized-linear kernels."""

from __future__ import annotations

import torch

from layerzero.core.quant_format import QuantFormat, QuantizedTensor

__all__ = ["oracle_weight"]


def oracle_weight(qt: QuantizedTensor) -> torch.Tensor:
    """float64 ``[N, K]`` of a 2-D int8 / fp8 (per channel or per tensor) or int4 (groups along K)
    QuantizedTensor.

    Raises:
        ValueError: another format or a weight that is not 2-D (a test's mistake)."""
    if len(qt.shape) != 2 or qt.format not in (
        QuantFormat.INT8,
        QuantFormat.FP8_E4M3,
        QuantFormat.FP8_E5M2,
        QuantFormat.INT4,
    ):
        raise ValueError(
            f"oracle_weight: expected a 2-D int8 / fp8 / int4 weight, got {qt.format} {tuple(qt.shape)}"
        )
    n, k = qt.shape
    if qt.format is QuantFormat.INT4:
        low, high = (qt.data & 15).double(), (qt.data >> 4).double()
        codes = torch.stack((low, high), dim=-1).reshape(n, k)
        g = qt.group_size
        zero = qt.zero_point.double().repeat_interleave(g, dim=1)
        return (codes - zero) * qt.scale.double().repeat_interleave(g, dim=1)
    return qt.data.double() * qt.scale.double()  # scale [N, 1] or []: broadcasts
