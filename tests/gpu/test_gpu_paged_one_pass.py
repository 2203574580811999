"""The ``one_pass`` knob compiled on a CUDA GPU (``pytest -m gpu tests/gpu/test_gpu_paged_one_pass.py``;
skipped on CPU): batch-1 decode in tables of at most ``small_batch``'s width, where each split of
``triton.paged_decode`` gathers its tiles at once (block ids read below the table's width: the garbage ids
past a sequence's blocks are read, never dereferenced), against the float64 oracle of
``test_gpu_triton_paged``, against the tile loop, eager (the fused split merge) against a CUDA-graph replay
(the merge kernel), over fp8 / int8 caches, and ``triton.rope_paged_decode`` the same way."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from test_gpu_rope_paged import TOL as ROPE_TOL  # tests/gpu is on sys.path (and tests/correctness, set there)
from test_gpu_rope_paged import cuda_case
from test_gpu_rope_paged import oracle as rope_oracle
from test_gpu_triton_paged import gpu_inputs, mismatch, oracle

import layerzero as lz
from layerzero.backends.triton import _paged_launch as tpl
from layerzero.backends.triton import paged as tp
from layerzero.backends.triton import rope_paged as trp
from layerzero.core.knobs import knobs
from layerzero.core.kv_layout import KVLayout
from layerzero.core.kv_quant import dequantize_kv, quantize_kv

pytestmark = pytest.mark.gpu
F64 = torch.float64
LENS = (1, 31, 32, 33, 255, 256, 257, 700, 1024, 1500, 2047, 2048)


@pytest.fixture
def paged_knobs():
    """``paged_knobs(field=value, ...)``: set ``triton.paged_decode`` knobs until the test ends (plans
    dropped)."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(knobs(tp.KNOBS, **fields))


def one_pass_plans() -> list[tuple[bool, int]]:
    return [(p.split_kw["ONE_PASS"], p.split_kw["CHUNKS"]) for p in tpl._PLANS.values()]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("page", "width"), [(16, 2048), (16, 1024), (5, 1025), (8, 512)])
def test_batch1_one_pass_matches_oracle_loop_and_graph(dtype, page, width, paged_knobs):
    """Splits of up to four tiles in one pass (``one_pass_max_tiles`` 4: the kernel's every form; the
    1025-token table has three a split)."""
    paged_knobs(one_pass_max_tiles=4)
    rng = random.Random(page * width)
    failures = []
    for n in (x for x in LENS if x <= width):
        c = dict(
            seed=rng.randint(0, 10**6),
            page=page,
            layout=rng.choice(("NHD", "HND")),
            d=128,
            hkv=8,
            ratio=2,
            lens=[n],
            spare_cols=-(-width // page) - -(-n // page),
            scale=None,
        )
        q, cache, table, lens = gpu_inputs(c, dtype)
        tpl._PLANS.clear()
        out = tp.paged_decode(q, cache, table, lens, None, c["layout"])
        assert one_pass_plans() and all(p for p, _ in one_pass_plans()), one_pass_plans()
        ref = oracle(q, cache, table, lens, c["layout"])
        for what, got in (("one pass", out), ("graph", _replayed(q, cache, table, lens, c["layout"]))):
            msg = mismatch(got, ref, dtype, f"{what} len {n} case {c}")
            if msg:
                failures.append(msg)
        with knobs(tp.KNOBS, one_pass=False):  # plans dropped on entry and exit
            loop = tp.paged_decode(q, cache, table, lens, None, c["layout"])
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
    """The fused kernel at batch 1 in a 2048-token table (128 pages of 16: one pass, 2 tiles a split on 132
    SMs): the new token from registers while the other splits read the cache concurrently."""
    args = cuda_case(11, dtype, 1, 16, 8, 128, 16, "NHD", True, False, skip=skip, width=128)
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    want, want_cache = rope_oracle(
        *(t.cpu() if t is not None else None for t in args), 128**-0.5, 1e-6, False, "NHD"
    )
    trp._PLANS.clear()
    got = trp.rope_paged_decode(
        q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens, None, None, False, KVLayout("NHD"), 1e-6
    )
    assert all(p.base.split_kw["ONE_PASS"] for p in trp._PLANS.values())
    err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    assert err <= ROPE_TOL[dtype], err
    diff = (cache.double().cpu() - want_cache.double()).abs().max().item()
    assert diff <= ROPE_TOL[dtype] * 4 * want_cache.double().abs().max().item(), diff


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_batch1_one_pass_over_a_quantized_cache(qdtype):
    """fp8 / int8 codes at batch 1 in a 2048-token table (one pass, bf16 queries): the float64 oracle over the
    dequantized cache, and the tile loop."""
    c = dict(
        seed=5, page=16, layout="NHD", d=128, hkv=8, ratio=2, lens=[1337], spare_cols=128 - 84, scale=None
    )
    q, cache, table, lens = gpu_inputs(c, torch.bfloat16)
    ks, vs = torch.tensor(0.05, device="cuda"), 0.04
    codes = (
        quantize_kv(torch.nan_to_num(cache[:, 0:1]), ks, qdtype),
        quantize_kv(torch.nan_to_num(cache[:, 1:2]), vs, qdtype),
    )
    deq = torch.cat((dequantize_kv(codes[0], ks, F64), dequantize_kv(codes[1], vs, F64)), dim=1)
    qcache = torch.cat(codes, dim=1)
    tpl._PLANS.clear()
    got = tp.paged_decode(q, qcache, table, lens, None, "NHD", k_scale=ks, v_scale=vs)
    assert all(p for p, _ in one_pass_plans()), one_pass_plans()
    assert mismatch(got, oracle(q, deq, table, lens, "NHD"), torch.bfloat16) is None
    with knobs(tp.KNOBS, one_pass=False):  # plans dropped on entry and exit
        loop = tp.paged_decode(q, qcache, table, lens, None, "NHD", k_scale=ks, v_scale=vs)
    assert mismatch(got, loop.double(), torch.bfloat16) is None


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_early_kv_reads_the_newest_position_the_kernel_before_wrote(layout, paged_knobs):
    """The ``early_kv`` knob (off by default) in a CUDA graph (PDL-launched on SM 9.0+): the KV write of the
    step's token (``triton.reshape_and_cache``) and then ``triton.paged_decode``, replayed for sequences of
    1 ... 2048 tokens whose newest slot holds NaN before each replay. The split kernel reads every older
    position before its PDL wait, so only the write just before can put the newest one in place: a stale read
    shows as NaN, or as a mismatch with the float64 oracle over the cache the replay left."""
    from layerzero.backends.triton import cache as tc

    paged_knobs(early_kv=True)  # off by default
    c = dict(seed=21, page=16, layout=layout, d=128, hkv=8, ratio=2, lens=[2048], spare_cols=0, scale=None)
    q, cache, table, _ = gpu_inputs(c, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    slot = torch.zeros(1, dtype=torch.int64, device="cuda")
    k_new = torch.zeros(1, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_new = torch.zeros_like(k_new)
    view = cache if layout == "NHD" else cache.transpose(2, 3)  # [N, 2, P, Hkv, D]

    def step() -> torch.Tensor:
        tc.reshape_and_cache(k_new, v_new, cache, slot, layout)
        return tp.paged_decode(q, cache, table, lens, None, layout)

    tpl._PLANS.clear()
    with lz.capture_selection():
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    assert all(p.split_kw["EARLY"] for p in tpl._PLANS.values()), "the graph did not take the EARLY one pass"
    failures = []
    for n in (1, 2, 31, 32, 33, 64, 255, 700, 1023, 1024, 1025, 2047, 2048):
        blk, off = int(table[0, (n - 1) // 16]), (n - 1) % 16
        view[blk, :, off] = float("nan")  # a stale read of the newest position poisons the output
        lens.fill_(n)
        slot.fill_(blk * 16 + off)
        k_new.copy_(torch.randn(k_new.shape, generator=gen, device="cuda"))
        v_new.copy_(torch.randn(v_new.shape, generator=gen, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(view[blk, 0, off], k_new[0]) and torch.equal(view[blk, 1, off], v_new[0])
        msg = mismatch(
            out.clone(), oracle(q, cache, table, lens, layout), torch.bfloat16, f"len {n} {layout}"
        )
        if msg:
            failures.append(msg)
    assert not failures, "\n".join(failures[:5])
