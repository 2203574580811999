"""Reference ``quantize`` / ``dequantize``: the oracle of every quantize kernel, written from the format
specs.

Plain PyTorch, all math in float32 (inputs are cast to float32 first; float64 inputs are rounded to float32
once, far below every format's step). Float formats never use torch's float8 casts: a value is rounded to its
format by searching the format's table of representable values (``core.quant_format.E4M3_VALUES`` ...) for the
nearest one, ties to the even code (IEEE round-to-nearest-even), so torch's native casts (used by
``torch_native``) are checked against the spec, not against themselves. Integer formats round with
``torch.round`` (half to even).

Formats (layouts: ``layerzero.core.quant_format``; docs/quantization.md):

- int8: symmetric, ``scale = max(amax / 127, 2**-126)``, ``q = clamp(round(x / scale), -127, 127)``.
- fp8 e4m3 / e5m2: ``scale = max(amax / fmax, 2**-126)``, ``q = fp8(clamp(x / scale, -fmax, fmax))``
  (fmax 448 / 57344), per tensor / channel / 1xg group / (bm, bk) block (DeepSeek-V3 block fp8).
- mxfp4 (OCP MX v1.0 sec. 6.3): 32-element blocks, ``X = 2**clamp(floor(log2(amax)) - 2, -127,
  127)`` as an E8M0 biased exponent, elements ``e2m1(clamp(x / X, -6, 6))``.
- nvfp4 (NVIDIA ModelOpt / TensorRT-LLM): ``g = max(amax(x) / (448 * 6), 2**-126)``; 16-element blocks,
  ``s = e4m3(clamp(amax_b / (6 g), 2**-9, 448))``, elements ``e2m1(clamp(x / (s g), -6, 6))``.
- int4 (GPTQ / AWQ asymmetric): per group of g along the last dim, ``lo = min(min(x), 0)``,
  ``hi = max(max(x), 0)``, ``scale = max((hi - lo) / 15, 2**-126)``,
  ``zero = clamp(round(-lo / scale), 0, 15)``, ``q = clamp(round(x / scale) + zero, 0, 15)``.
"""

from __future__ import annotations

import math

import torch

from layerzero.core.quant_format import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MIN_SUBNORMAL,
    E4M3_VALUES,
    E5M2_VALUES,
    E8M0_BIAS,
    FIXED_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    INT4_MAX,
    INT8_MAX,
    MIN_SCALE,
    NVFP4_GLOBAL_DIVISOR,
    QuantFormat,
    QuantizedTensor,
    blocked_shape,
    format_granularity,
    keep_shape,
    scale_shape,
)

__all__ = ["dequantize", "pack_nibbles", "quantize", "round_to_code", "unpack_nibbles"]

F32 = torch.float32
_FP8_VALUES = {QuantFormat.FP8_E4M3: E4M3_VALUES, QuantFormat.FP8_E5M2: E5M2_VALUES}
# decoding tables of all 128 non-negative codes: e4m3fn 0x7F is NaN; e5m2 0x7C is inf, 0x7D-0x7F NaN
_FP8_DECODE = {
    QuantFormat.FP8_E4M3: E4M3_VALUES + (math.nan,),
    QuantFormat.FP8_E5M2: E5M2_VALUES + (math.inf, math.nan, math.nan, math.nan),
}
_E8M0_VALUES = tuple(math.ldexp(1.0, c - E8M0_BIAS) for c in range(255)) + (math.nan,)  # 0xFF is NaN


def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=F32, device=device)


def round_to_code(a: torch.Tensor, values: tuple[float, ...]) -> torch.Tensor:
    """Round-to-nearest-even onto a format: ``a`` (float32, >= 0, <= ``values[-1]``) -> the int64 code whose
    value (``values[code]``, ascending) is nearest; a tie goes to the even code (the one whose mantissa ends
    in 0)."""
    grid = _table(values, a.device)
    hi = torch.searchsorted(grid, a).clamp(max=len(values) - 1)  # first value >= a
    lo = (hi - 1).clamp(min=0)
    below, above = a - grid[lo], grid[hi] - a  # exact: neighbours within a factor 2 (Sterbenz)
    take_hi = (above < below) | ((above == below) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., K]`` (K even, values 0..15) -> uint8 ``[..., K/2]``:
    ``byte = code[2i] + 16 * code[2i+1]``."""
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] + 16 * pairs[..., 1]


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` -> the 4-bit codes ``[..., K]`` (uint8): the low nibble first (inverse of
    pack)."""
    return torch.stack((data % 16, data // 16), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)


def _e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """float32 values already clamped to [-6, 6] -> E2M1 codes (sign bit 3), rounded to nearest even."""
    return round_to_code(y.abs(), E2M1_VALUES) + 8 * torch.signbit(y).long()


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    mag = _table(E2M1_VALUES, codes.device)[(codes % 8).long()]
    return torch.where(codes >= 8, -mag, mag)


def _fp8_decode(raw: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """float8 tensor (or its uint8 bits) -> float32 values from the format's table (bit 7 is the sign)."""
    codes = raw.view(torch.uint8).long()
    mag = _table(_FP8_DECODE[fmt], raw.device)[codes % 128]
    return torch.where(codes >= 128, -mag, mag)


def quantize(
    x: torch.Tensor, fmt: QuantFormat, axis: int | None, group_size: int | tuple[int, int] | None
) -> QuantizedTensor:
    """``x`` (any float dtype, shape checked by the ops layer) -> :class:`QuantizedTensor` in ``fmt``
    (canonical args: ``axis`` non-negative or None; ``group_size`` normalized: 32 mxfp4, 16 nvfp4, g int4)."""
    x32 = x.detach().to(F32).contiguous()
    shape = tuple(x.shape)
    gran = format_granularity(fmt, axis, group_size)
    view, dims = blocked_shape(shape, gran, axis, group_size)
    xb = x32.reshape(view)
    zero_point = global_scale = None
    if fmt is QuantFormat.INT8:
        scale = (xb.abs().amax(dim=dims, keepdim=True) / INT8_MAX).clamp_min(MIN_SCALE)
        data = torch.round(xb / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif fmt in FP8_MAX:
        fmax = FP8_MAX[fmt]
        scale = (xb.abs().amax(dim=dims, keepdim=True) / fmax).clamp_min(MIN_SCALE)
        y = (xb / scale).clamp(-fmax, fmax)
        codes = round_to_code(y.abs(), _FP8_VALUES[fmt]) + 128 * torch.signbit(y).long()
        data = codes.to(torch.uint8).view(FP8_DTYPE[fmt])
    elif fmt is QuantFormat.MXFP4:
        amax = xb.abs().amax(dim=-1, keepdim=True)
        _, e = torch.frexp(amax)  # amax = m * 2**e with m in [0.5, 1): floor(log2(amax)) = e - 1
        shared = torch.where(amax > 0, e - 1 - 2, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)  # 2 = emax of E2M1
        code = (shared + E8M0_BIAS).long()
        y = (xb / _table(_E8M0_VALUES, x.device)[code]).clamp(-E2M1_MAX, E2M1_MAX)
        data, scale = pack_nibbles(_e2m1_encode(y).reshape(shape)), code.to(torch.uint8)
    elif fmt is QuantFormat.NVFP4:
        global_scale = (x32.abs().amax() / NVFP4_GLOBAL_DIVISOR).clamp_min(MIN_SCALE)
        s = (xb.abs().amax(dim=-1, keepdim=True) / (6.0 * global_scale)).clamp(
            E4M3_MIN_SUBNORMAL, FP8_MAX[QuantFormat.FP8_E4M3]
        )
        s_code = round_to_code(s, E4M3_VALUES)
        total = _table(E4M3_VALUES, x.device)[s_code] * global_scale
        y = (xb / total).clamp(-E2M1_MAX, E2M1_MAX)
        data = pack_nibbles(_e2m1_encode(y).reshape(shape))
        scale = s_code.to(torch.uint8).view(torch.float8_e4m3fn)
    else:  # INT4
        lo = xb.amin(dim=-1, keepdim=True).clamp(max=0.0)
        hi = xb.amax(dim=-1, keepdim=True).clamp(min=0.0)
        scale = ((hi - lo) / INT4_MAX).clamp_min(MIN_SCALE)
        zero = torch.round(-lo / scale).clamp(0, INT4_MAX)
        q = (torch.round(xb / scale) + zero).clamp(0, INT4_MAX)
        data = pack_nibbles(q.reshape(shape))
        zero_point = zero.to(torch.uint8).reshape(scale_shape(shape, gran, axis, group_size))
    if fmt in (QuantFormat.INT8, *FP8_MAX):
        data = data.reshape(shape)
    scale = scale.reshape(scale_shape(shape, gran, axis, group_size))
    return QuantizedTensor(data, scale, zero_point, global_scale, fmt, x.shape, x.dtype, axis, group_size)


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """:class:`QuantizedTensor` -> a new tensor of ``qt.shape`` in ``qt.dtype`` (codes decoded from the format
    tables, times the scales in float32, one rounding to ``qt.dtype``)."""
    fmt, shape = qt.format, tuple(qt.shape)
    gran = format_granularity(fmt, qt.axis, qt.group_size)
    view, dims = blocked_shape(shape, gran, qt.axis, qt.group_size)
    keep = keep_shape(view, dims)
    dev = qt.data.device
    if fmt is QuantFormat.INT8:
        vals = qt.data.to(F32).reshape(view) * qt.scale.reshape(keep)
    elif fmt in FP8_MAX:
        vals = _fp8_decode(qt.data, fmt).reshape(view) * qt.scale.reshape(keep)
    elif fmt in FIXED_BLOCK:
        e2m1 = _e2m1_decode(unpack_nibbles(qt.data)).reshape(view)
        if fmt is QuantFormat.MXFP4:
            vals = e2m1 * _table(_E8M0_VALUES, dev)[qt.scale.long().reshape(keep)]
        else:
            vals = e2m1 * (_fp8_decode(qt.scale, QuantFormat.FP8_E4M3).reshape(keep) * qt.global_scale)
    else:  # INT4
        q = unpack_nibbles(qt.data).to(F32).reshape(view)
        vals = (q - qt.zero_point.to(F32).reshape(keep)) * qt.scale.reshape(keep)
    return vals.reshape(shape).to(qt.dtype)
