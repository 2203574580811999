"""Convert ``lz.quantize(w, "int4")`` results to and from GPTQ's int32 packing (AutoGPTQ / Hugging Face
``GPTQConfig`` checkpoints, vLLM's ``gptq`` loader): no dispatch, pure layout.

LayerZero's int4 layout for a linear weight ``w [N, K]`` (N = out_features, K = in_features, groups of g along
K): ``data`` uint8 ``[N, K/2]`` (``w[n, 2i]`` in the low nibble of ``data[n, i]``), ``scale`` float32
``[N, K/g]``, ``zero_point`` uint8 ``[N, K/g]``, ``w ~= (q - zero) * scale``.

GPTQ's layout (``QuantLinear`` buffers, 4 bits):

- ``qweight`` int32 ``[K/8, N]``: bits ``4j..4j+3`` of ``qweight[i, n]`` hold ``q[n, 8i + j]`` (8 codes along
  K);
- ``qzeros`` int32 ``[K/g, N/8]``: bits ``4j..4j+3`` of ``qzeros[c, i]`` hold the zero point of ``(n = 8i + j,
  group c)``; checkpoint format ``"gptq"`` (AutoGPTQ, the default of most checkpoints) stores ``zero - 1``,
  ``"gptq_v2"`` (GPTQModel) stores ``zero``;
- ``scales`` ``[K/g, N]`` (float16 in checkpoints); ``g_idx`` int32 ``[K]`` = ``k // g`` (no act-order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from layerzero.core.errors import InvalidInputError, expected_got
from layerzero.core.quant_format import QuantFormat, QuantizedTensor

__all__ = ["GPTQWeights", "from_gptq", "to_gptq"]

_FORMATS = ("gptq", "gptq_v2")
_SHIFTS = tuple(4 * j for j in range(8))


class GPTQWeights(NamedTuple):
    """GPTQ ``QuantLinear`` buffers (see the module docstring for the bit layout)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor


def layout_error(what: str, expected: str, got: object, fix: str | None = None) -> InvalidInputError:
    """The error of a bad checkpoint buffer or weight for a layout conversion (GPTQ's here, AWQ's in
    ``awq.py``): ``what``, expected vs got, how to fix it (raise the return value)."""
    return InvalidInputError(expected_got(what, expected, got, fix))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int codes ``[R, 8, C]`` (0..15) -> int32 ``[R, C]``: code j in bits 4j..4j+3 (two's complement
    int32)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=codes.device).view(1, 8, 1)
    words = (codes.to(torch.int64) << shifts).sum(dim=1)  # < 2**32, exact in int64
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` -> int64 codes ``[R, 8, C]`` (inverse of :func:`pack_nibbles`)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=words.device).view(1, 8, 1)
    return (words.to(torch.int64).unsqueeze(1) >> shifts) & 15


def _check_format(checkpoint_format: str) -> None:
    if checkpoint_format not in _FORMATS:
        raise layout_error(
            "checkpoint_format",
            f"one of {list(_FORMATS)}",
            repr(checkpoint_format),
            "'gptq' (AutoGPTQ) stores zero - 1; 'gptq_v2' (GPTQModel) stores the zero point itself.",
        )


def to_gptq(
    qt: QuantizedTensor, *, checkpoint_format: str = "gptq", scale_dtype: torch.dtype = torch.float16
) -> GPTQWeights:
    """Repack an int4 :class:`QuantizedTensor` of a weight ``[N, K]`` (N, K multiples of 8) into GPTQ buffers.

    ``scale_dtype``: the dtype of ``scales`` (float16 as checkpoints store it; float32 keeps ours exactly).

    Raises:
        InvalidInputError: not int4, not 2-D, N or K not a multiple of 8, an unknown ``checkpoint_format``, or
            (for ``"gptq"``, which stores ``zero - 1`` in 4 bits) a zero point of 0 (export ``"gptq_v2"``
            instead; read on the host).
    """
    _check_format(checkpoint_format)
    if not isinstance(qt, QuantizedTensor) or qt.format is not QuantFormat.INT4:
        raise layout_error(
            "to_gptq: qt",
            "an int4 QuantizedTensor (lz.quantize(w, 'int4'))",
            getattr(qt, "format", type(qt).__name__),
        )
    if len(qt.shape) != 2 or qt.shape[0] % 8 or qt.shape[1] % 8:
        raise layout_error("to_gptq: weight shape", "[N, K] with N and K multiples of 8", list(qt.shape))
    n, k = qt.shape
    g = int(qt.group_size)  # type: ignore[arg-type]
    codes = torch.stack((qt.data & 15, qt.data >> 4), dim=-1).reshape(n, k)  # [N, K]
    qweight = pack_nibbles(codes.t().reshape(k // 8, 8, n))  # [K/8, N]
    zeros = qt.zero_point.to(torch.int64).t()  # [K/g, N]
    if checkpoint_format == "gptq":
        if bool((zeros == 0).any()):
            raise layout_error(
                "to_gptq: zero points",
                "1..15 for checkpoint_format='gptq' (it stores zero - 1 in 4 bits)",
                "a zero point of 0 (a group with no negative values)",
                "Export checkpoint_format='gptq_v2'.",
            )
        zeros = zeros - 1
    qzeros = pack_nibbles(zeros.reshape(k // g, n // 8, 8).transpose(1, 2))  # [K/g, N/8]
    scales = qt.scale.t().contiguous().to(scale_dtype)  # [K/g, N]
    g_idx = torch.arange(k, dtype=torch.int32, device=qt.data.device) // g
    return GPTQWeights(qweight, qzeros, scales, g_idx)


def from_gptq(
    weights: GPTQWeights | tuple[torch.Tensor, ...],
    *,
    group_size: int,
    checkpoint_format: str = "gptq",
    dtype: torch.dtype = torch.float16,
) -> QuantizedTensor:
    """GPTQ buffers (``qweight [K/8, N]``, ``qzeros [K/g, N/8]``, ``scales [K/g, N]``, optionally
    ``g_idx [K]``) -> an int4 :class:`QuantizedTensor` of the weight ``[N, K]`` in ``dtype``. Groups must be
    contiguous along K: a given ``g_idx`` must equal ``k // group_size`` (GPTQ's ``desc_act=False``).

    Raises:
        InvalidInputError: buffers of the wrong dtype / shape, a group size that does not divide K, an unknown
            ``checkpoint_format``, a ``g_idx`` of another shape or with other values (an act-order checkpoint,
            ``desc_act=True``: its groups interleave along K, which this layout cannot hold; read on the
            host).
    """
    _check_format(checkpoint_format)
    qweight, qzeros, scales = weights[0], weights[1], weights[2]
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 2:
            raise layout_error(
                f"from_gptq: {name}", "a 2-D int32 tensor", getattr(t, "dtype", type(t).__name__)
            )
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if not isinstance(group_size, int) or group_size < 1 or k % group_size:
        raise layout_error("from_gptq: group_size", f"an int >= 1 dividing K = {k}", repr(group_size))
    ng = k // group_size
    if (
        tuple(qzeros.shape) != (ng, n // 8)
        or not isinstance(scales, torch.Tensor)
        or tuple(scales.shape) != (ng, n)
    ):
        raise layout_error(
            "from_gptq: qzeros / scales shapes",
            f"[{ng}, {n // 8}] / [{ng}, {n}]",
            f"{list(qzeros.shape)} / {list(getattr(scales, 'shape', []))}",
        )
    g_idx = weights[3] if len(weights) > 3 else None
    if g_idx is not None:
        want = torch.arange(k, device=qweight.device) // group_size
        if (
            not isinstance(g_idx, torch.Tensor)
            or tuple(g_idx.shape) != (k,)
            or not torch.equal(g_idx.to(device=want.device, dtype=want.dtype), want)
        ):
            raise layout_error(
                "from_gptq: g_idx",
                f"k // group_size for k in 0..{k - 1} (groups contiguous along K)",
                "an act-order g_idx (desc_act=True) or a tensor of another shape",
                "Act-order GPTQ checkpoints are not supported: quantize the weight with lz.quantize, or "
                "load a checkpoint made with desc_act=False; pass g_idx=None to skip the check.",
            )
    codes = unpack_nibbles(qweight).reshape(k, n).t()  # [N, K]
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    zeros = unpack_nibbles(qzeros).transpose(1, 2).reshape(ng, n)  # [K/g, N]
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) & 15
    return QuantizedTensor(
        data.contiguous(),
        scales.t().to(torch.float32).contiguous(),
        zeros.t().to(torch.uint8).contiguous(),
        None,
        QuantFormat.INT4,
        torch.Size((n, k)),
        dtype,
        None,
        group_size,
    )
