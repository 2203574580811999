"""Quantized formats: the :class:`QuantFormat` enum, the :class:`QuantizedTensor` that ``lz.quantize``
returns, and the format facts (code grids, maxima, block geometry) shared by the ops layer and every quantize
kernel (backends import core, so the facts live here once, like ``core/kv_layout.py``). docs/quantization.md
is the long form.

Memory layout of ``QuantizedTensor`` per format (x ``[..., K]`` the original tensor, K its last dim):

- ``int8``: data int8 like x (codes in [-127, 127]); scale float32, one per group (see *granularity*).
- ``fp8_e4m3`` / ``fp8_e5m2``: data ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` like x; scale float32, one
  per group.
- ``mxfp4``: data uint8 ``[..., K/2]`` (two E2M1 codes per byte); scale uint8 ``[..., K/32]`` (E8M0 biased
  exponents, ``2**(s - 127)``).
- ``nvfp4``: data uint8 ``[..., K/2]``; scale ``float8_e4m3fn`` ``[..., K/16]``; ``global_scale`` float32
  ``[]``.
- ``int4``: data uint8 ``[..., K/2]`` (two codes 0..15 per byte); scale float32 ``[..., K/g]``; ``zero_point``
  uint8 ``[..., K/g]``.

Packed 4-bit data: element ``2i`` of the last dim in the low nibble of byte ``i``, element ``2i+1`` in the
high nibble (``byte = code[2i] | code[2i+1] << 4``), as PyTorch's ``torch.float4_e2m1fn_x2`` and cuBLAS' FP4
GEMMs expect (``data.view(torch.float4_e2m1fn_x2)`` on torch >= 2.8). E2M1 codes: bit 3 sign, bits 2-1
exponent (bias 1), bit 0 mantissa; magnitudes of codes 0..7 are :data:`E2M1_VALUES`.

Granularity (int8 / fp8; ``scale`` always broadcasts against x once reshaped as below): ``tensor`` (scale
``[]``), ``channel`` (``axis=k``: scale shaped like x with 1 in every dim but k), ``group`` (``group_size=g``:
g consecutive elements of the last dim, scale ``[..., K/g]``; per-token is ``g = K``, DeepSeek-V3's 1x128
activation tiles ``g = 128``) and ``block`` (``group_size=(bm, bk)``: 2-D tiles over the last two dims, scale
``[..., M/bm, K/bk]``; DeepSeek-V3 / vLLM block-fp8 weights use ``(128, 128)``).
"""

from __future__ import annotations

import difflib
import enum
import math
from typing import Any, NamedTuple

import torch

from .errors import InvalidInputError, expected_got


class QuantFormat(str, enum.Enum):
    """A quantized format; a ``str`` enum, so it compares equal to its name
    (``QuantFormat.INT8 == "int8"``)."""

    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"
    INT4 = "int4"


QUANT_FORMATS: tuple[str, ...] = tuple(f.value for f in QuantFormat)
_BY_NAME: dict[Any, QuantFormat] = {**{f.value: f for f in QuantFormat}, **{f: f for f in QuantFormat}}


def parse_quant_format(value: Any, what: str = "format") -> QuantFormat:
    """``"int8"`` / ... (or a :class:`QuantFormat`) -> :class:`QuantFormat`; parsed once at the API edge.

    Raises:
        InvalidInputError: anything else; the message lists every supported format.
    """
    fmt = _BY_NAME.get(value) if isinstance(value, str) else None
    if fmt is None:
        if isinstance(value, str):
            close = difflib.get_close_matches(value.lower(), QUANT_FORMATS, n=1)
            fix = f"Did you mean {close[0]!r}?" if close else None
        else:
            fix = "Pass the format's name as a string, e.g. 'int8', or a lz.QuantFormat."
        raise InvalidInputError(expected_got(what, f"one of {list(QUANT_FORMATS)}", repr(value), fix))
    return fmt


class Granularity(str, enum.Enum):
    """Which elements share one scale (see the module docstring)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"


def granularity(axis: int | None, group_size: int | tuple[int, int] | None) -> Granularity:
    """The :class:`Granularity` of normalized ``axis`` / ``group_size`` (at most one of them is set)."""
    if axis is not None:
        return Granularity.CHANNEL
    if group_size is None:
        return Granularity.TENSOR
    return Granularity.BLOCK if isinstance(group_size, tuple) else Granularity.GROUP


# ----------------------------------------------------------------------------- format constants

INT8_MAX = 127
"""Symmetric int8: codes in [-127, 127] (-128 unused, as vLLM / SmoothQuant)."""
INT4_MAX = 15
"""Asymmetric int4 (GPTQ / AWQ): unsigned codes 0..15 with a per-group zero point in 0..15."""
FP8_MAX = {QuantFormat.FP8_E4M3: 448.0, QuantFormat.FP8_E5M2: 57344.0}
FP8_DTYPE = {QuantFormat.FP8_E4M3: torch.float8_e4m3fn, QuantFormat.FP8_E5M2: torch.float8_e5m2}
E2M1_MAX = 6.0
MXFP4_BLOCK = 32
"""OCP MX v1.0: 32 elements share one E8M0 scale."""
NVFP4_BLOCK = 16
"""NVIDIA NVFP4: 16 elements share one FP8 E4M3 scale, times one float32 global scale per tensor."""
NVFP4_GLOBAL_DIVISOR = 448.0 * 6.0
"""NVFP4 global scale = amax(x) / (448 * 6): ModelOpt's ``weight_scale_2`` (a multiplier in
dequantization)."""
E4M3_MIN_SUBNORMAL = 2.0**-9
INT4_DEFAULT_GROUP = 128
FIXED_BLOCK = {QuantFormat.MXFP4: MXFP4_BLOCK, QuantFormat.NVFP4: NVFP4_BLOCK}
MIN_SCALE = 2.0**-126
"""Every float32 scale is at least float32's smallest normal: a group of zeros gets this scale and codes 0."""
E8M0_BIAS = 127


def minifloat_values(man_bits: int, bias: int, codes: int) -> tuple[float, ...]:
    """The values of the non-negative codes ``0..codes-1`` of a sign-exponent-mantissa float format
    (IEEE-style subnormals at exponent field 0), exact (``math.ldexp``). Code order is value order."""
    out = []
    for code in range(codes):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        out.append(
            math.ldexp(m, 1 - bias - man_bits)
            if e == 0
            else math.ldexp((1 << man_bits) + m, e - bias - man_bits)
        )
    return tuple(out)


E2M1_VALUES = minifloat_values(1, 1, 8)
"""E2M1 magnitudes of codes 0..7: (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
E4M3_VALUES = minifloat_values(3, 7, 127)
"""``float8_e4m3fn`` magnitudes of codes 0..126 (0x7F is NaN; no infinities), max 448."""
E5M2_VALUES = minifloat_values(2, 15, 124)
"""``float8_e5m2`` magnitudes of codes 0..123 (0x7C is +inf), max 57344."""


# ----------------------------------------------------------------------------- the quantized tensor


class QuantizedTensor(NamedTuple):
    """The result of ``lz.quantize``; ``lz.dequantize`` turns it back into a ``dtype`` tensor of ``shape``.

    A ``NamedTuple`` (immutable, ``torch.compile``-friendly, compared field by field by ``lz.tune`` and
    canaries). Layouts per format: see :mod:`layerzero.core.quant_format` and docs/quantization.md.

    Fields:
        data: the codes (int8, float8, or uint8 holding two 4-bit codes per byte along the last dim, low
            first).
        scale: the scales: float32 (int8, fp8, int4), uint8 E8M0 biased exponents (mxfp4: value
            ``2**(s - 127)``), ``float8_e4m3fn`` (nvfp4 block scales).
        zero_point: int4 only: uint8 ``[..., K/g]`` in 0..15, ``x ~= (q - zero_point) * scale``; else None.
        global_scale: nvfp4 only: float32 ``[]``, ``x ~= e2m1 * (float(scale) * global_scale)``; else None.
        format: the :class:`QuantFormat`.
        shape: the original ``torch.Size``.
        dtype: the original float dtype (what ``lz.dequantize`` returns).
        axis: the channel dim (non-negative) for per-channel int8/fp8, else None.
        group_size: elements per scale along the last dim (int), a ``(bm, bk)`` 2-D tile (int8/fp8 block), or
            None (per-tensor / per-channel); 32 for mxfp4, 16 for nvfp4, g for int4.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    global_scale: torch.Tensor | None
    format: QuantFormat
    shape: torch.Size
    dtype: torch.dtype
    axis: int | None
    group_size: int | tuple[int, int] | None

    @property
    def granularity(self) -> Granularity:
        """Which elements share one scale."""
        return format_granularity(self.format, self.axis, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes held by data, scales, zero points and the global scale."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.data, self.scale, self.zero_point, self.global_scale)
            if t is not None
        )


# ----------------------------------------------------------------------------- block geometry


def blocked_shape(
    shape: tuple[int, ...], gran: Granularity, axis: int | None, group_size: int | tuple[int, int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(view_shape, reduce_dims)``: x reshaped to ``view_shape`` (a view of contiguous x) puts each group's
    elements along ``reduce_dims``; ``amax(reduce_dims, keepdim=True)`` then has one entry per scale, in the
    order of the stored scale (see :func:`scale_shape`)."""
    if gran is Granularity.TENSOR:
        return (math.prod(shape),), (0,)
    if gran is Granularity.CHANNEL:
        k = int(axis)  # type: ignore[arg-type]
        return (math.prod(shape[:k]), shape[k], math.prod(shape[k + 1 :])), (0, 2)
    *lead, k = shape
    if gran is Granularity.GROUP:
        g = int(group_size)  # type: ignore[arg-type]
        return (*lead, k // g, g), (-1,)
    bm, bk = group_size  # type: ignore[misc]
    *lead2, m = lead
    return (*lead2, m // bm, bm, k // bk, bk), (-3, -1)


def keep_shape(view_shape: tuple[int, ...], reduce_dims: tuple[int, ...]) -> tuple[int, ...]:
    """``view_shape`` with every dim of ``reduce_dims`` set to 1: the shape of
    ``amax(reduce_dims, keepdim=True)``, which a stored scale is reshaped to for broadcasting against the
    blocked view."""
    n = len(view_shape)
    dims = {d % n for d in reduce_dims}
    return tuple(1 if i in dims else s for i, s in enumerate(view_shape))


def scale_shape(
    shape: tuple[int, ...], gran: Granularity, axis: int | None, group_size: int | tuple[int, int] | None
) -> tuple[int, ...]:
    """The stored scale's shape for an x of ``shape`` (see the module docstring)."""
    if gran is Granularity.TENSOR:
        return ()
    if gran is Granularity.CHANNEL:
        return tuple(n if i == axis else 1 for i, n in enumerate(shape))
    *lead, k = shape
    if gran is Granularity.GROUP:
        return (*lead, k // int(group_size))  # type: ignore[arg-type]
    bm, bk = group_size  # type: ignore[misc]
    *lead2, m = lead
    return (*lead2, m // bm, k // bk)


def format_granularity(
    fmt: QuantFormat, axis: int | None, group_size: int | tuple[int, int] | None
) -> Granularity:
    """The granularity of a format's call: int4 / mxfp4 / nvfp4 are always GROUP along the last dim."""
    if fmt in FIXED_BLOCK or fmt is QuantFormat.INT4:
        return Granularity.GROUP
    return granularity(axis, group_size)


_SCALE_DTYPE = {QuantFormat.MXFP4: torch.uint8, QuantFormat.NVFP4: torch.float8_e4m3fn}
_DATA_DTYPE = {QuantFormat.INT8: torch.int8, **FP8_DTYPE}


_Layout = tuple[torch.dtype, tuple[int, ...]]


def storage_layout(
    fmt: QuantFormat, shape: tuple[int, ...], axis: int | None, group_size: int | tuple[int, int] | None
) -> tuple[_Layout, _Layout, _Layout | None, _Layout | None]:
    """(dtype, shape) of a QuantizedTensor's data, scale, zero point and global scale (None: the format has
    none) for a tensor of ``shape`` quantized to ``fmt`` with normalized ``axis`` / ``group_size``
    (docs/quantization.md's layout table): what ``lz.dequantize`` checks and ``lz.quantize``'s custom op's
    fake returns."""
    packed = fmt in FIXED_BLOCK or fmt is QuantFormat.INT4
    data = (torch.uint8, (*shape[:-1], shape[-1] // 2)) if packed else (_DATA_DTYPE[fmt], shape)
    sshape = scale_shape(shape, format_granularity(fmt, axis, group_size), axis, group_size)
    return (
        data,
        (_SCALE_DTYPE.get(fmt, torch.float32), sshape),
        (torch.uint8, sshape) if fmt is QuantFormat.INT4 else None,
        (torch.float32, ()) if fmt is QuantFormat.NVFP4 else None,
    )
