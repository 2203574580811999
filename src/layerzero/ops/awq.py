"""Convert ``lz.quantize(w, "int4")`` results to and from AWQ's int32 packing (AutoAWQ's ``WQLinear_GEMM``
checkpoints, Hugging Face ``AwqConfig(version="gemm")``, vLLM's ``awq`` loader): no dispatch, pure layout.

LayerZero's int4 layout for a linear weight ``w [N, K]`` (N = out_features, K = in_features, groups of g along
K): ``data`` uint8 ``[N, K/2]`` (``w[n, 2i]`` in the low nibble of ``data[n, i]``), ``scale`` float32
``[N, K/g]``, ``zero_point`` uint8 ``[N, K/g]``, ``w ~= (q - zero) * scale``.

AWQ's GEMM layout (Lin et al. 2023, "AWQ"; AutoAWQ ``WQLinear_GEMM.from_linear``), 4 bits, packed along N in
an interleaved order:

- ``qweight`` int32 ``[K, N/8]``: bits ``4i..4i+3`` of ``qweight[k, c]`` hold ``q[8c + ORDER[i], k]`` with
  ``ORDER = (0, 2, 4, 6, 1, 3, 5, 7)`` (so the nibbles of a word, low to high, are columns 0, 2, 4, 6, 1, 3,
  5, 7 of its group of eight);
- ``qzeros`` int32 ``[K/g, N/8]``: the zero points ``zero[n, c]`` packed the same way along N (stored as they
  are, not ``zero - 1`` as GPTQ's v1 format does);
- ``scales`` ``[K/g, N]`` (float16 in checkpoints).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from layerzero.core.quant_format import QuantFormat, QuantizedTensor

from .gptq import layout_error, pack_nibbles, unpack_nibbles

__all__ = ["AWQ_ORDER", "AWQWeights", "from_awq", "to_awq"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Column (within a group of eight along N) held by nibble i of an AWQ word."""
_INVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))  # nibble that holds column j: (0, 4, 1, 5, 2, 6, 3, 7)


class AWQWeights(NamedTuple):
    """AWQ ``WQLinear_GEMM`` buffers (see the module docstring for the bit layout)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor


def _pack_columns(codes: torch.Tensor) -> torch.Tensor:
    """int codes ``[R, N]`` (0..15, N a multiple of 8) -> int32 ``[R, N/8]`` in AWQ's nibble order."""
    r, n = codes.shape
    grouped = codes.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)]  # nibble i <- column ORDER[i]
    return pack_nibbles(grouped.transpose(1, 2))


def _unpack_columns(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, N/8]`` -> int64 codes ``[R, N]`` (inverse of :func:`_pack_columns`)."""
    nibbles = unpack_nibbles(words).transpose(1, 2)  # [R, N/8, 8]: nibble i
    return nibbles[:, :, list(_INVERSE)].reshape(words.shape[0], -1)


def to_awq(qt: QuantizedTensor, *, scale_dtype: torch.dtype = torch.float16) -> AWQWeights:
    """Repack an int4 :class:`QuantizedTensor` of a weight ``[N, K]`` (N a multiple of 8) into AWQ's GEMM
    buffers ``qweight [K, N/8]``, ``qzeros [K/g, N/8]`` (int32) and ``scales [K/g, N]`` in ``scale_dtype``
    (float16 as checkpoints store it; float32 keeps ours exactly).

    Raises:
        InvalidInputError: not int4, not 2-D, N not a multiple of 8, or no zero points.
    """
    if not isinstance(qt, QuantizedTensor) or qt.format is not QuantFormat.INT4:
        raise layout_error(
            "to_awq: qt",
            "an int4 QuantizedTensor (lz.quantize(w, 'int4'))",
            getattr(qt, "format", type(qt).__name__),
        )
    if len(qt.shape) != 2 or qt.shape[0] % 8:
        raise layout_error(
            "to_awq: weight shape",
            "[N, K] with N a multiple of 8 (AWQ packs 8 codes along N)",
            list(qt.shape),
        )
    n, k = qt.shape
    codes = torch.stack((qt.data & 15, qt.data >> 4), dim=-1).reshape(n, k)  # [N, K]
    qweight = _pack_columns(codes.t())  # [K, N/8]
    if qt.zero_point is None:
        raise layout_error("to_awq: qt.zero_point", "a uint8 tensor (int4 is asymmetric)", None)
    qzeros = _pack_columns(qt.zero_point.to(torch.int64).t())  # [K/g, N/8]
    return AWQWeights(qweight, qzeros, qt.scale.t().contiguous().to(scale_dtype))


def from_awq(
    weights: AWQWeights | tuple[torch.Tensor, ...], *, group_size: int, dtype: torch.dtype = torch.float16
) -> QuantizedTensor:
    """AWQ GEMM buffers (``qweight [K, N/8]``, ``qzeros [K/g, N/8]``, ``scales [K/g, N]``) -> an int4
    :class:`QuantizedTensor` of the weight ``[N, K]`` in ``dtype`` (dequantizing it gives AutoAWQ's
    ``dequantize_gemm(...)`` transposed: ``(q - zero) * scale``).

    Raises:
        InvalidInputError: buffers of the wrong dtype / shape, or a group size that is not an even int
            dividing K.
    """
    qweight, qzeros, scales = weights[0], weights[1], weights[2]
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 2:
            raise layout_error(
                f"from_awq: {name}", "a 2-D int32 tensor", getattr(t, "dtype", type(t).__name__)
            )
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2 or k % group_size:
        raise layout_error("from_awq: group_size", f"an even int >= 2 dividing K = {k}", repr(group_size))
    ng = k // group_size
    if (
        tuple(qzeros.shape) != (ng, n // 8)
        or not isinstance(scales, torch.Tensor)
        or tuple(scales.shape) != (ng, n)
    ):
        raise layout_error(
            "from_awq: qzeros / scales shapes",
            f"[{ng}, {n // 8}] / [{ng}, {n}]",
            f"{list(qzeros.shape)} / {list(getattr(scales, 'shape', []))}",
        )
    codes = _unpack_columns(qweight).t()  # [N, K]
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    zeros = _unpack_columns(qzeros).t()  # [N, K/g]
    return QuantizedTensor(
        data.contiguous(),
        scales.t().to(torch.float32).contiguous(),
        zeros.to(torch.uint8).contiguous(),
        None,
        QuantFormat.INT4,
        torch.Size((n, k)),
        dtype,
        None,
        group_size,
    )
