"""``lz.quantize`` -> ``lz.dequantize`` against float64 oracles, on every CPU kernel (each locked in turn).

- Hand-worked cases per format: the codes, scales and dequantized values worked out on paper (round half to
  even for int8/int4, round-to-nearest-even and saturation for fp8 / E2M1, E8M0 and E4M3 scales).
- Round-trip error bounds derived from each format, checked element by element in float64 on seeded random
  shapes (odd sizes, 0-3 leading dims, values spread over 6 decades, zero groups) in every float dtype: int8 /
  int4 ``|x - deq| <= scale / 2``; fp8 ``<= max(2**-4 |x|, 2**-10 scale)`` (e4m3; e5m2: ``2**-3``,
  ``2**-17``); E2M1 ``<= t * halfstep(|x| / t) + max(0, |x| - 6 t)`` with t the block's total scale and
  halfstep the grid's half spacing (0.25 below 2, 0.5 below 4, 1 up to 6); the saturation part ``< 2 t`` for
  MXFP4 (amax < 8X) and ``<= 0.4 t`` for NVFP4 when the E4M3 block scale is normal.
Slack for float32 arithmetic: ``2**-21 |x|``, plus half an ulp of the output dtype.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _quant_cases import DTYPES, FORMATS, KERNELS, quant_case  # noqa: E402

import layerzero as lz  # noqa: E402

pytestmark = pytest.mark.correctness
F64 = torch.float64
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7, worked out from E2M1 (bias 1, one mantissa bit)


def run(backend: str, x: torch.Tensor, fmt: str, **kw) -> tuple[lz.QuantizedTensor, torch.Tensor]:
    """quantize and dequantize with both ops locked to ``backend``'s kernels."""
    lz.lock("quantize", f"{backend}.quantize")
    lz.lock("dequantize", f"{backend}.dequantize")
    try:
        with lz.trace() as t:
            qt = lz.quantize(x, fmt, **kw)
            out = lz.dequantize(qt)
    finally:
        lz.unlock("quantize")
        lz.unlock("dequantize")
    assert t.counts == {("quantize", f"{backend}.quantize"): 1, ("dequantize", f"{backend}.dequantize"): 1}
    return qt, out


def nibbles(codes: list[int]) -> list[int]:
    """Pack by hand: byte i = codes[2i] + 16 * codes[2i + 1]."""
    return [codes[i] + 16 * codes[i + 1] for i in range(0, len(codes), 2)]


# ----------------------------------------------------------------------------- hand-worked cases


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("kw", [{"axis": 0}, {"group_size": 4}])
def test_int8_per_token_by_hand(backend, kw):
    # row 0: amax 127 -> scale 1; row 1: amax 15.875 = 127/8 -> scale 1/8; 0.5, 1.5, 2.5 steps round half to
    # even
    x = torch.tensor([[1.0, -2.0, 127.0, 0.0], [0.0625, 0.1875, -15.875, 0.3125]])
    qt, out = run(backend, x, "int8", **kw)
    assert qt.data.tolist() == [[1, -2, 127, 0], [0, 2, -127, 2]]
    assert qt.scale.tolist() == [[1.0], [0.125]]
    assert out.tolist() == [[1.0, -2.0, 127.0, 0.0], [0.0, 0.25, -15.875, 0.25]]


@pytest.mark.parametrize("backend", KERNELS)
def test_fp8_e4m3_per_tensor_by_hand(backend):
    # amax 448 -> scale 1. 1+2^-4 ties 1.0/1.125 -> 1.0; 1+3*2^-4 ties 1.125/1.25 -> 1.25; 2^-10 ties 0/2^-9
    # -> 0; 1.5*2^-9 ties 2^-9/2^-8 -> 2^-8; -300 -> -288 (step 32 in [256, 512)); -2^-12 -> -0
    x = torch.tensor([448.0, 1 + 2**-4, 1 + 3 * 2**-4, 2**-10, 1.5 * 2**-9, -300.0, -(2**-12), 0.0])
    qt, out = run(backend, x, "fp8_e4m3")
    assert qt.data.view(torch.uint8).tolist() == [0x7E, 0x38, 0x3A, 0x00, 0x02, 0xF9, 0x80, 0x00]
    assert qt.scale.item() == 1.0 and qt.data.dtype == torch.float8_e4m3fn
    assert out.tolist() == [448.0, 1.0, 1.25, 0.0, 2**-8, -288.0, -0.0, 0.0]


@pytest.mark.parametrize("backend", KERNELS)
def test_fp8_e5m2_per_tensor_by_hand(backend):
    # amax 57344 -> scale 1. 1.125 ties 1.0/1.25 -> 1.0; 1.375 ties 1.25/1.5 -> 1.5; 2^-17 ties 0/2^-16 -> 0;
    # 3*2^-17 ties 2^-16/2^-15 -> 2^-15
    x = torch.tensor([57344.0, 1.125, 1.375, 2**-17, 3 * 2**-17, -1.0])
    qt, out = run(backend, x, "fp8_e5m2")
    assert qt.data.view(torch.uint8).tolist() == [0x7B, 0x3C, 0x3E, 0x00, 0x02, 0xBC]
    assert out.tolist() == [57344.0, 1.0, 1.5, 0.0, 2**-15, -1.0]


MX_ROW0 = [48, -48, 0, 4, 8, 12, 16, 24, 32, 2, 6, 10, 14, 20, 28, 40, -4, -1, 44, -20, 3, 1, -28, 36] + [
    0
] * 8
MX_CODES0 = [7, 15, 0, 1, 2, 3, 4, 5, 6, 0, 2, 2, 4, 4, 6, 6, 9, 8, 7, 12, 1, 0, 14, 6] + [0] * 8


@pytest.mark.parametrize("backend", KERNELS)
def test_mxfp4_blocks_by_hand(backend):
    """Row 0: amax 48 = 6 * 2^3, floor(log2 48) = 5, X = 2^(5-2) = 8 (E8M0 code 130); x / 8 hits every E2M1
    value and every tie (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4: the even
    code), -1/8 -> -0. Row 1: amax 7, X = 1 (code 127): 7 and 6.5 saturate to 6."""
    row1 = [7.0, -7.0, 6.5, 0.3] + [0.0] * 28
    x = torch.tensor([[float(v) for v in MX_ROW0], row1])
    qt, out = run(backend, x, "mxfp4")
    codes1 = [7, 15, 7, 1] + [0] * 28
    assert qt.scale.tolist() == [[130], [127]] and qt.scale.dtype == torch.uint8
    assert qt.data.tolist() == [nibbles(MX_CODES0), nibbles(codes1)]
    assert qt.data[0, 0].item() == 0xF7  # codes 7 (low nibble) and 15 (high)
    sign = lambda c: -1.0 if c >= 8 else 1.0  # noqa: E731
    assert out.tolist() == [
        [sign(c) * E2M1[c % 8] * s for c in codes] for codes, s in ((MX_CODES0, 8), (codes1, 1))
    ]


@pytest.mark.parametrize("backend", KERNELS)
def test_nvfp4_blocks_by_hand(backend):
    """amax(x) = 2688 = 448 * 6 -> global scale 1. Block 0: amax 2688 -> E4M3 scale 448 (code 0x7E). Block 1:
    amax 6.375 -> 1.0625, which ties 1.0/1.125 in E4M3 -> 1.0 (0x38); 6.375 then saturates to 6; 5 ties 4/6
    -> 4."""
    b0 = [2688.0, -1344.0, 672.0, 224.0, 112.0, 336.0] + [0.0] * 10
    b1 = [6.375, 5.0, 1.25, -0.75, 2.5] + [0.0] * 11
    qt, out = run(backend, torch.tensor([b0 + b1]), "nvfp4")
    c0, c1 = [7, 13, 3, 1, 0, 2] + [0] * 10, [7, 6, 2, 10, 4] + [0] * 11
    assert qt.global_scale.item() == 1.0 and qt.scale.view(torch.uint8).tolist() == [[0x7E, 0x38]]
    assert qt.data.tolist() == [nibbles(c0 + c1)]
    assert out.tolist() == [
        [2688.0, -1344.0, 672.0, 224.0, 0.0, 448.0] + [0.0] * 10 + [6.0, 4.0, 1.0, -1.0, 2.0] + [0.0] * 11
    ]


@pytest.mark.parametrize("backend", KERNELS)
def test_int4_groups_by_hand(backend):
    """Row 0: lo -3, hi 4.5 -> scale 7.5/15 = 0.5, zero round(3/0.5) = 6; 0.25/0.5 = 0.5 -> 0, 0.75 -> 1.5 ->
    2, -1.25 -> -2.5 -> -2 (half to even). Row 1: no negatives -> lo 0, zero 0."""
    x = torch.tensor(
        [[-3.0, 4.5, 0.0, 0.25, 0.75, -1.25, 1.0, 2.0], [0.0, 1.5, 3.0, 7.5, 0.5, 1.0, 2.0, 2.5]]
    )
    qt, out = run(backend, x, "int4", group_size=8)
    assert qt.data.tolist() == [[0xF0, 0x66, 0x48, 0xA8], [0x30, 0xF6, 0x21, 0x54]]
    assert qt.scale.tolist() == [[0.5], [0.5]] and qt.zero_point.tolist() == [[6], [0]]
    assert out.tolist() == [
        [-3.0, 4.5, 0.0, 0.0, 1.0, -1.0, 1.0, 2.0],
        [0.0, 1.5, 3.0, 7.5, 0.5, 1.0, 2.0, 2.5],
    ]


@pytest.mark.parametrize("backend", KERNELS)
def test_zero_groups_get_the_minimum_scale_and_zero_codes(backend):
    x = torch.zeros(2, 32)
    for fmt in ("int8", "fp8_e4m3", "mxfp4", "nvfp4", "int4"):
        qt, out = run(backend, x, fmt, **({"group_size": 32} if fmt == "int4" else {}))
        assert torch.equal(out, x) and not qt.data.view(torch.uint8).any(), fmt
    assert run(backend, x, "int8")[0].scale.item() == 2.0**-126
    assert run(backend, x, "mxfp4")[0].scale.tolist() == [
        [0],
        [0],
    ]  # E8M0 2^-127, the clamp of OCP MX sec. 6.3


# --------------------------------------------------------------------------- random round trips vs the bounds


def _expand(scale: torch.Tensor, qt: lz.QuantizedTensor) -> torch.Tensor:
    """Per-element float64 scale: each group's scale repeated over its elements."""
    shape = tuple(qt.shape)
    s = scale.to(F64)
    if qt.axis is not None or s.dim() == 0:
        return s.expand(shape)
    if isinstance(qt.group_size, tuple):
        bm, bk = qt.group_size
        return s.repeat_interleave(bm, dim=-2).repeat_interleave(bk, dim=-1)
    return s.repeat_interleave(qt.group_size, dim=-1)


def _halfstep(a: torch.Tensor) -> torch.Tensor:
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)).to(F64)


def bound(qt: lz.QuantizedTensor, x64: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The format's per-element error bound (float64) and, for E2M1 formats, the saturation part."""
    fmt = qt.format.value
    ax = x64.abs()
    if fmt in ("int8", "int4"):
        return _expand(qt.scale, qt) / 2, None
    if fmt.startswith("fp8"):
        rel, sub = (2.0**-4, 2.0**-10) if fmt == "fp8_e4m3" else (2.0**-3, 2.0**-17)
        return torch.maximum(rel * ax, sub * _expand(qt.scale, qt)), None
    if fmt == "mxfp4":
        t = _expand(
            torch.tensor([2.0 ** (c - 127) for c in qt.scale.flatten().tolist()], dtype=F64).reshape(
                qt.scale.shape
            ),
            qt,
        )
    else:
        t = _expand(qt.scale.to(F64) * qt.global_scale.to(F64), qt)
    sat = (ax - 6 * t).clamp(min=0)
    return t * _halfstep((ax / t).clamp(max=6)) + sat, sat / t


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_within_the_format_bound(backend, dtype, fmt):
    half_ulp = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11}.get(dtype, 0.0)
    for seed in range(25):
        x, kw = quant_case(seed * 7 + FORMATS.index(fmt), fmt, dtype)
        qt, out = run(backend, x, fmt, **kw)
        assert out.shape == x.shape and out.dtype == dtype and qt.dtype == dtype and qt.shape == x.shape
        x64 = x.to(F64)
        err = (out.to(F64) - x64).abs()
        b, sat = bound(qt, x64)
        limit = b + x64.abs() * (2.0**-21 + half_ulp) + out.to(F64).abs() * half_ulp + 1e-300
        bad = err > limit
        assert not bad.any(), (
            fmt,
            kw,
            tuple(x.shape),
            f"{int(bad.sum())} elements over the bound; first at "
            f"{bad.nonzero()[0].tolist()}: x={x64[bad][0]:.6g} deq={out.to(F64)[bad][0]:.6g} "
            f"bound={limit[bad][0]:.3g}",
        )
        if fmt == "mxfp4":
            assert float(sat.max()) < 2.0, "MX saturation reaches 2X or more: amax >= 8X"
        if fmt == "nvfp4":
            normal = (qt.scale.to(F64) >= 2.0**-6).repeat_interleave(16, dim=-1)
            if normal.any():
                assert float(sat[normal].amax()) <= 0.4 + 1e-6, (
                    "NVFP4 saturation over 0.4 t (normal block scale)"
                )


def test_seeded_cases_cover_every_granularity_and_odd_sizes():
    seen = set()
    for fmt in FORMATS:
        for seed in range(25):
            x, kw = quant_case(seed * 7 + FORMATS.index(fmt), fmt, torch.float32)
            seen.add((fmt, "axis" if "axis" in kw else type(kw.get("group_size")).__name__))
            seen.add(("odd", any(n % 2 for n in x.shape)))
    assert {
        (f, k) for f in ("int8", "fp8_e4m3", "fp8_e5m2") for k in ("axis", "int", "tuple", "NoneType")
    } <= seen
    assert {("mxfp4", "int"), ("nvfp4", "int"), ("int4", "int"), ("odd", True)} <= seen
