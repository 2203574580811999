"""``paged.ONE_PASS`` compiled on a CUDA GPU (``pytest -m gpu tests/gpu/test_gpu_paged_one_pass.py``; skipped on CPU):
batch-1 decode in tables of at most ``SMALL_BATCH``'s width, where each split of ``triton.paged_decode`` gathers its
tiles at once (block ids read below the table's width: the garbage ids past a sequence's blocks are read, never
dereferenced), against the float64 oracle of ``test_gpu_triton_paged``, against the tile loop, eager (the fused split
merge) against a CUDA-graph replay (the merge kernel), over fp8 / int8 caches, and ``triton.rope_paged_decode`` the
same way."""

from __future__ import annotations

import random

import pytest
import torch
from test_gpu_rope_paged import TOL as ROPE_TOL  # tests/gpu is on sys.path (and tests/correctness, set there)
from test_gpu_rope_paged import cuda_case
from test_gpu_rope_paged import oracle as rope_oracle
from test_gpu_triton_paged import gpu_inputs, mismatch, oracle

import layerzero as lz
from layerzero.backends.triton import paged as tp
from layerzero.backends.triton import rope_paged as trp
from layerzero.core.kv_layout import KVLayout
from layerzero.core.kv_quant import dequantize_kv, quantize_kv

pytestmark = pytest.mark.gpu
F64 = torch.float64
LENS = (1, 31, 32, 33, 255, 256, 257, 700, 1024, 1500, 2047, 2048)


def one_pass_plans() -> list[tuple[bool, int]]:
    return [(p.split_kw["ONE_PASS"], p.split_kw["CHUNKS"]) for p in tp._PLANS.values()]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("page", "width"), [(16, 2048), (16, 1024), (5, 1025), (8, 512)])
def test_batch1_one_pass_matches_oracle_loop_and_graph(dtype, page, width, monkeypatch):
    """Splits of up to four tiles in one pass (``ONE_PASS_MAX_TILES`` 4: the kernel's every form; the 1025-token
    table has three a split)."""
    monkeypatch.setattr(tp, "ONE_PASS_MAX_TILES", 4)
    rng = random.Random(page * width)
    failures = []
    for n in (x for x in LENS if x <= width):
        c = dict(seed=rng.randint(0, 10**6), page=page, layout=rng.choice(("NHD", "HND")), d=128, hkv=8, ratio=2,
                 lens=[n], spare_cols=-(-width // page) - -(-n // page), scale=None)
        q, cache, table, lens = gpu_inputs(c, dtype)
        tp._PLANS.clear()
        out = tp.paged_decode(q, cache, table, lens, None, c["layout"])
        assert one_pass_plans() and all(p for p, _ in one_pass_plans()), one_pass_plans()
        ref = oracle(q, cache, table, lens, c["layout"])
        for what, got in (("one pass", out), ("graph", _replayed(q, cache, table, lens, c["layout"]))):
            msg = mismatch(got, ref, dtype, f"{what} len {n} case {c}")
            if msg:
                failures.append(msg)
        old, tp.ONE_PASS = tp.ONE_PASS, False
        try:
            tp._PLANS.clear()
            loop = tp.paged_decode(q, cache, table, lens, None, c["layout"])
        finally:
            tp.ONE_PASS = old
            tp._PLANS.clear()
        msg = mismatch(out, loop.double(), dtype, f"one pass vs loop, len {n} case {c}")
        if msg:
            failures.append(msg)
    assert not failures, "\n".join(failures[:5])


def _replayed(q, cache, table, lens, layout) -> torch.Tensor:
    """A CUDA graph of the call (two kernels: split + merge), replayed once."""
    with lz.capture_selection():
        tp.paged_decode(q, cache, table, lens, None, layout)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tp.paged_decode(q, cache, table, lens, None, layout)
    g.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.usefixtures("triton_usable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("skip", [False, True])
def test_rope_paged_one_pass_matches_float64(dtype, skip):
    """The fused kernel at batch 1 in a 2048-token table (128 pages of 16: one pass, 2 tiles a split on 132 SMs):
    the new token from registers while the other splits read the cache concurrently."""
    args = cuda_case(11, dtype, 1, 16, 8, 128, 16, "NHD", True, False, skip=skip, width=128)
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    want, want_cache = rope_oracle(*(t.cpu() if t is not None else None for t in args), 128 ** -0.5, 1e-6, False,
                                   "NHD")
    trp._PLANS.clear()
    got = trp.rope_paged_decode(q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens, None, None, False,
                                KVLayout("NHD"), 1e-6)
    assert all(p.base.split_kw["ONE_PASS"] for p in trp._PLANS.values())
    err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    assert err <= ROPE_TOL[dtype], err
    diff = (cache.double().cpu() - want_cache.double()).abs().max().item()
    assert diff <= ROPE_TOL[dtype] * 4 * want_cache.double().abs().max().item(), diff


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_batch1_one_pass_over_a_quantized_cache(qdtype):
    """fp8 / int8 codes at batch 1 in a 2048-token table (one pass, bf16 queries): the float64 oracle over the
    dequantized cache, and the tile loop."""
    c = dict(seed=5, page=16, layout="NHD", d=128, hkv=8, ratio=2, lens=[1337], spare_cols=128 - 84, scale=None)
    q, cache, table, lens = gpu_inputs(c, torch.bfloat16)
    ks, vs = torch.tensor(0.05, device="cuda"), 0.04
    codes = (quantize_kv(torch.nan_to_num(cache[:, 0:1]), ks, qdtype),
             quantize_kv(torch.nan_to_num(cache[:, 1:2]), vs, qdtype))
    deq = torch.cat((dequantize_kv(codes[0], ks, F64), dequantize_kv(codes[1], vs, F64)), dim=1)
    qcache = torch.cat(codes, dim=1)
    tp._PLANS.clear()
    got = tp.paged_decode(q, qcache, table, lens, None, "NHD", k_scale=ks, v_scale=vs)
    assert all(p for p, _ in one_pass_plans()), one_pass_plans()
    assert mismatch(got, oracle(q, deq, table, lens, "NHD"), torch.bfloat16) is None
    old, tp.ONE_PASS = tp.ONE_PASS, False
    try:
        tp._PLANS.clear()
        loop = tp.paged_decode(q, qcache, table, lens, None, "NHD", k_scale=ks, v_scale=vs)
    finally:
        tp.ONE_PASS = old
        tp._PLANS.clear()
    assert mismatch(got, loop.double(), torch.bfloat16) is None
