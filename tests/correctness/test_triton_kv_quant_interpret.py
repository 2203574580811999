"""Quantized paged KV caches (float8_e4m3fn, int8) in our Triton kernels, on CPU through the Triton
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py when no CUDA device is visible):

- ``triton.reshape_and_cache`` writes exactly ``core.kv_quant.quantize_kv``'s codes (bit for bit: halfway
  values round to even, values past the format saturate, -1 slots write nothing), scales as floats and as
  device tensors;
- ``triton.paged_decode`` over a quantized cache equals a float64 decode over the dequantized cache
  (``codes * scale``) within the query dtype's tolerance, split and unsplit, NHD and HND;
- ``triton.paged_prefill`` (and its lse form) over a quantized cache: a ragged prefill / append / decode batch
  equals float64 attention over the dequantized cache, causal and not;
- the KernelSpecs declare the quantized cache dtypes, so selection keeps them for quantized pools (graph-safe:
  the engine's decode graphs can be captured with ``kv_cache_dtype="fp8" | "int8"``).
The compiled kernels are covered by tests/gpu/test_gpu_paged_quant_kv.py."""

from __future__ import annotations

import pytest
import torch
from _triton_interp import needs_interpreter
from test_cascade_ops import case as prefill_case
from test_cascade_ops import oracle as prefill_oracle
from test_triton_paged_interpret import make_case, oracle

from layerzero.backends.triton import cache as tc
from layerzero.backends.triton import cascade as tcas
from layerzero.backends.triton import paged as tp
from layerzero.core.kv_quant import dequantize_kv, quantize_kv

pytestmark = pytest.mark.correctness

interpreted = needs_interpreter("tests/gpu/test_gpu_paged_quant_kv.py")
QDTYPES = [torch.int8, torch.float8_e4m3fn]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@interpreted
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("tensor_scale", [False, True], ids=["float", "tensor"])
def test_write_equals_quantize_kv_bit_for_bit(qdtype, layout, tensor_scale):
    g = torch.Generator().manual_seed(7)
    t, hkv, d, page, blocks = 9, 2, 20, 4, 6
    k = (torch.randint(-600, 600, (t, hkv, d), generator=g) * 0.25).to(
        torch.bfloat16
    )  # x / 0.5: halves -> ties
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.25, -0.75])  # saturation both ways; ties at 0.5 and -1.5
    k[0, 1, :3] = torch.tensor(
        [-4e-4, -0.0, 4e-4]
    )  # round to -0.0 / stay -0.0 (fp8 code 0x80) / round to +0.0
    v = (torch.randn(t, hkv, d, generator=g) * 40).to(torch.bfloat16)
    ks, vs = 0.5, 0.37
    slots = torch.tensor([3, 0, -1, 23, 5, 12, -1, 7, 18])
    shape = (blocks, 2, page, hkv, d) if layout == "NHD" else (blocks, 2, hkv, page, d)
    cache = torch.zeros(shape, dtype=qdtype)
    want = cache.clone()
    kq, vq = quantize_kv(k, ks, qdtype), quantize_kv(v, vs, qdtype)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            b, o = divmod(s, page)
            if layout == "NHD":
                want[b, 0, o], want[b, 1, o] = kq[i], vq[i]
            else:
                want[b, 0, :, o], want[b, 1, :, o] = kq[i], vq[i]
    args = (torch.tensor(ks), torch.tensor(vs)) if tensor_scale else (ks, vs)
    tc.reshape_and_cache(k, v, cache, slots, layout, *args)
    assert torch.equal(_bits(cache), _bits(want))


@interpreted
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize(
    ("layout", "splits", "dtype"),
    [("NHD", None, torch.float32), ("HND", 3, torch.float32), ("NHD", 2, torch.bfloat16)],
    ids=["nhd", "hnd-split", "bf16"],
)
def test_decode_over_quantized_cache_matches_float64(qdtype, layout, splits, dtype):
    q, cache, table, lens = make_case(
        3, layout=layout, page=8, ratio=4, hkv=2, d=32, lens=[1, 37, 20], dtype=torch.float32
    )
    q = q.to(dtype)
    ks, vs = 0.03, torch.tensor(0.021)  # one scale by value, one on the device
    codes = (
        quantize_kv(torch.nan_to_num(cache[:, 0:1]), ks, qdtype),
        quantize_kv(torch.nan_to_num(cache[:, 1:2]), vs, qdtype),
    )
    qcache = torch.cat(codes, dim=1)
    deq = torch.cat(
        (dequantize_kv(codes[0], ks, torch.float64), dequantize_kv(codes[1], vs, torch.float64)), dim=1
    )
    out = tp.paged_decode(
        q, qcache, table, lens, None, layout, num_splits=splits, block_n=16, k_scale=ks, v_scale=vs
    )
    ref = oracle(q, deq, table, lens, layout)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@interpreted
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_over_quantized_cache_matches_float64(qdtype, seed, causal):
    """``triton.paged_prefill`` (op ``paged_attention``) and ``triton.paged_prefill_lse`` over codes: ragged
    prefill / append / decode rows (``test_cascade_ops.case``), one scale by value and one on the device."""
    layout = "HND" if seed % 2 else "NHD"
    q, cache, tables, lens, cu = prefill_case(seed + 40, layout)
    ks, vs = 0.03, torch.tensor(0.021)
    codes = quantize_kv(cache[:, 0:1], ks, qdtype), quantize_kv(cache[:, 1:2], vs, qdtype)
    qcache = torch.cat(codes, dim=1)
    deq = torch.cat(
        (dequantize_kv(codes[0], ks, torch.float64), dequantize_kv(codes[1], vs, torch.float64)), dim=1
    )
    ref_out, ref_lse = prefill_oracle(q, deq, tables, lens, cu, layout, causal)
    out = tcas.paged_prefill(q, qcache, tables, lens, cu, None, causal, layout, ks, vs)
    out2, lse = tcas.paged_prefill_lse(q, qcache, tables, lens, cu, None, causal, layout, ks, vs)
    assert out.dtype == torch.float32 and torch.equal(out, out2)
    tol = TOL[torch.float32]
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)


def test_specs_declare_quantized_caches():
    specs = {s.kernel_id: s for s in tp.kernel_specs(True, "")}
    for spec in (
        tc.kernel_spec(True, ""),
        specs["triton.paged_decode"],
        specs["triton.paged_prefill"],
        specs["triton.paged_prefill_lse"],
    ):
        assert spec.kv_cache_dtypes == {torch.int8, torch.float8_e4m3fn} and spec.graph_safe
