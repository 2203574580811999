"""Every ``quantize`` / ``dequantize`` kernel against ``reference`` bit for bit, and the format primitives.

- Every registered kernel of both ops that can run on the CPU, locked, on seeded ``_quant_cases`` (every
  format, granularity and dtype): data, scales, zero points and global scales equal the reference's bit for
  bit, and so does the dequantized tensor.
- 4-bit packing is lossless: all 256 bytes unpack to (low, high) nibbles and pack back, in both backends.
- Decoding: all 16 E2M1 codes (hand table), all 256 fp8 codes (reference tables vs torch's float8 casts).
- Rounding at every tie: every midpoint between consecutive e4m3 / e5m2 / E2M1 values and its float32
  neighbours round the same in the reference (nearest-value search, ties to even) and torch_native (torch
  casts, bucketize).
- MXFP4 is idempotent: quantizing a dequantized tensor gives back the same codes and scales.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _quant_cases import DTYPES, FORMATS, quant_case  # noqa: E402

import layerzero as lz  # noqa: E402
from layerzero.backends.reference import quantize as ref_q  # noqa: E402
from layerzero.backends.torch_native import quantize as native_q  # noqa: E402
from layerzero.core.quant_format import E4M3_VALUES, E5M2_VALUES, QuantFormat, QuantizedTensor  # noqa: E402

pytestmark = pytest.mark.correctness
E2M1_SIGNED = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _cpu_kernels(op: str) -> list[str]:
    return sorted(
        k["kernel_id"]
        for k in lz.list_kernels(op)
        if k["available"] and "cpu" in k["device_types"] and k["kernel_id"] != f"reference.{op}"
    )


def locked(op: str, kernel_id: str, *args, **kw):
    lz.lock(op, kernel_id)
    try:
        return getattr(lz, op)(*args, **kw)
    finally:
        lz.unlock(op)


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor's bytes as uint8 (so -0.0 != 0.0 and NaN == NaN compare as stored)."""
    return None if t is None else t.reshape(-1).contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def test_the_cpu_kernels_under_test():
    assert _cpu_kernels("quantize") == ["torch_native.quantize"]
    assert _cpu_kernels("dequantize") == ["torch_native.dequantize"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_kernel_matches_the_reference_bit_for_bit(fmt, dtype):
    for seed in range(30):
        x, kw = quant_case(1000 + seed * 7 + FORMATS.index(fmt), fmt, dtype)
        ref = locked("quantize", "reference.quantize", x, fmt, **kw)
        ref_out = locked("dequantize", "reference.dequantize", ref)
        for kid in _cpu_kernels("quantize"):
            got = locked("quantize", kid, x, fmt, **kw)
            for name in ("data", "scale", "zero_point", "global_scale"):
                assert same_bits(getattr(got, name), getattr(ref, name)), (kid, fmt, kw, tuple(x.shape), name)
            assert got[4:] == ref[4:], (kid, got[4:], ref[4:])
        for kid in _cpu_kernels("dequantize"):
            assert same_bits(locked("dequantize", kid, ref), ref_out), (kid, fmt, kw, tuple(x.shape))


@pytest.mark.parametrize("mod", [ref_q, native_q], ids=["reference", "torch_native"])
def test_nibble_packing_is_lossless_on_every_byte_and_code(mod):
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    codes = mod.unpack_nibbles(every_byte)
    assert codes.shape == (4, 128) and codes.dtype == torch.uint8
    flat = codes.reshape(-1, 2)
    assert flat[:, 0].tolist() == [b % 16 for b in range(256)] and flat[:, 1].tolist() == [
        b // 16 for b in range(256)
    ]
    assert torch.equal(mod.pack_nibbles(codes), every_byte)
    pairs = torch.cartesian_prod(torch.arange(16), torch.arange(16)).reshape(1, 512)  # all 16 x 16 code pairs
    assert torch.equal(mod.unpack_nibbles(mod.pack_nibbles(pairs)), pairs.to(torch.uint8))


@pytest.mark.parametrize("backend", ["reference", "torch_native"])
def test_all_16_e2m1_codes_decode_by_hand(backend):
    data = torch.tensor(
        [[c0 | (c1 << 4) for c0, c1 in zip(range(0, 16, 2), range(1, 16, 2), strict=True)] * 2],
        dtype=torch.uint8,
    )  # [1, 16] bytes = codes 0..15 twice
    mx = QuantizedTensor(
        data,
        torch.tensor([[127]], dtype=torch.uint8),
        None,
        None,
        QuantFormat.MXFP4,
        torch.Size((1, 32)),
        torch.float32,
        None,
        32,
    )
    nv = QuantizedTensor(
        data,
        torch.ones(1, 2).to(torch.float8_e4m3fn),
        None,
        torch.tensor(2.0),
        QuantFormat.NVFP4,
        torch.Size((1, 32)),
        torch.float32,
        None,
        16,
    )
    out_mx = locked("dequantize", f"{backend}.dequantize", mx)
    out_nv = locked("dequantize", f"{backend}.dequantize", nv)
    assert (
        out_mx[0].tolist() == list(E2M1_SIGNED) * 2 and out_nv[0].tolist() == [2 * v for v in E2M1_SIGNED] * 2
    )
    assert torch.signbit(out_mx[0, 8])  # code 8 is -0.0


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_all_256_fp8_codes_decode_like_torch(fmt):
    dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
    data = torch.arange(256, dtype=torch.uint8).view(dt)
    qt = QuantizedTensor(
        data, torch.tensor(1.0), None, None, QuantFormat(fmt), torch.Size((256,)), torch.float32, None, None
    )
    want = data.to(torch.float32)
    for kid in ("reference.dequantize", "torch_native.dequantize"):
        got = locked("dequantize", kid, qt)
        assert torch.equal(got.isnan(), want.isnan()) and same_bits(
            got[~want.isnan()], want[~want.isnan()]
        ), kid


def _neighbours(mids: torch.Tensor) -> torch.Tensor:
    """float32 midpoints and their float32 neighbours below and above."""
    return torch.cat(
        [
            mids,
            torch.nextafter(mids, torch.zeros_like(mids)),
            torch.nextafter(mids, torch.full_like(mids, 1e9)),
        ]
    )


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_ties_round_to_even_in_every_kernel(fmt):
    values = torch.tensor(E4M3_VALUES if fmt == "fp8_e4m3" else E5M2_VALUES, dtype=torch.float64)
    v = _neighbours(((values[1:] + values[:-1]) / 2).float())  # midpoints are exact in float32
    fmax = float(values[-1])
    x = torch.cat([torch.tensor([fmax]), v, -v])  # amax = fmax: scale 1, the codes are the rounding itself
    ref = locked("quantize", "reference.quantize", x, fmt)
    assert ref.scale.item() == 1.0
    got = locked("quantize", "torch_native.quantize", x, fmt)
    assert same_bits(got.data, ref.data)
    assert same_bits(got.data, x.to(torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2))
    codes = bits(ref.data)[
        1 : 1 + v.numel() // 3
    ].long()  # the exact midpoints: every one lands on an even code
    assert bool((codes % 2 == 0).all())


def test_e2m1_ties_round_to_even_in_every_kernel():
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = _neighbours((mags[1:] + mags[:-1]) / 2)  # 21 values
    v = torch.cat([v, -v, torch.rand(21) * 6])
    rows = torch.cat(
        [torch.full((63, 1), 6.0), v[:, None], torch.zeros(63, 30)], dim=1
    )  # amax 6: X = 1, s = 1
    for fmt in ("mxfp4", "nvfp4"):
        x = rows if fmt == "mxfp4" else rows[:, :16].reshape(63, 16)
        ref = locked("quantize", "reference.quantize", x, fmt)
        got = locked("quantize", "torch_native.quantize", x, fmt)
        assert same_bits(got.data, ref.data) and same_bits(got.scale, ref.scale), fmt
        codes = ref.data[:, 0] >> 4  # element 1 of each row: the high nibble of byte 0
        assert (codes[:7] % 2 == 0).all() and (codes[21:28] % 2 == 0).all(), (fmt, codes[:7].tolist())
        assert codes[:7].tolist() == [0, 2, 2, 4, 4, 6, 6]  # 0.25 0.75 1.25 1.75 2.5 3.5 5 -> even codes


@pytest.mark.parametrize("backend", ["reference", "torch_native"])
def test_mxfp4_requantizing_its_own_output_is_exact(backend):
    for seed in range(20):
        x, kw = quant_case(2000 + seed, "mxfp4", torch.float32)
        qt = locked("quantize", f"{backend}.quantize", x, "mxfp4", **kw)
        again = locked(
            "quantize",
            f"{backend}.quantize",
            locked("dequantize", f"{backend}.dequantize", qt),
            "mxfp4",
            **kw,
        )
        nz = qt.scale > 0  # an all-zero block may pick a different (irrelevant) scale
        assert same_bits(again.data, qt.data) and torch.equal(again.scale[nz], qt.scale[nz]), seed
