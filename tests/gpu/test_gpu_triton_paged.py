"""``triton.paged_decode`` on a CUDA GPU (``pytest -m gpu tests/gpu/test_gpu_triton_paged.py``; skipped on
CPU).

- 200 seeded decode cases per dtype (float16 / bfloat16; a few float32) against a float64 oracle: page sizes
  1, 8, 16, 32; NHD and HND; GQA ratios 1..16; head dims 64, 80, 96, 128, 256; batch up to 64; KV up to 32768;
  length-1 sequences; every unused page and slot NaN; block-table entries past the used ones garbage;
- through ``lz.paged_attention``: the kernel is chosen for CUDA decode and serves it;
- a CUDA graph: ``lz.warmup`` then ``lz.validate_graph_capture`` of a decode step; the capture trace shows
  ``triton.paged_decode`` and replay == eager.

Compile budget: launch constexprs are only the dtype, head dim, its padded size and the tile size, so the
400 cases compile a few dozen kernels.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.backends.triton import _paged_launch as tpl
from layerzero.backends.triton import paged as tp
from layerzero.core.knobs import knobs
from layerzero.core.runtime import RUNTIME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import mismatch  # noqa: E402

pytestmark = pytest.mark.gpu
F64 = torch.float64
PAGES = (1, 8, 16, 32)
CASES_PER_DTYPE = 200


def gpu_case(seed: int) -> dict:
    """Case ``seed``: cycles page sizes and layouts; one of three regimes (long KV with a small batch, a big
    batch of short/medium sequences, a mixed batch with many length-1 sequences)."""
    rng = random.Random(seed * 104729 + 7)
    page = PAGES[seed % 4]
    layout = ("NHD", "HND")[(seed // 4) % 2]
    d = rng.choice((64, 128, 128, 256, 80, 96))
    hkv = rng.choice((1, 2, 4, 8)) if d < 256 else rng.choice((1, 2))
    ratio = rng.choice((1, 2, 4, 5, 8, 16))
    regime = seed % 3
    if regime == 0:  # long context, small batch
        b = rng.randint(1, 3)
        lens = [rng.choice((rng.randint(1, 32768), 32768, rng.randint(4000, 20000))) for _ in range(b)]
        if page == 1:  # keep the block table small
            lens = [min(n, 8192) for n in lens]
    elif regime == 1:  # big batch
        b = rng.randint(16, 64)
        lens = [rng.choice((1, rng.randint(1, 300), rng.randint(1, 2048))) for _ in range(b)]
    else:  # mixed, many length-1
        b = rng.randint(1, 16)
        lens = [rng.choice((1, 1, 2, rng.randint(1, 64), rng.randint(100, 4096))) for _ in range(b)]
    return dict(
        seed=seed,
        page=page,
        layout=layout,
        d=d,
        hkv=hkv,
        ratio=ratio,
        lens=lens,
        spare_cols=rng.randint(0, 3),
        scale=rng.choice((None, None, 0.05)),
    )


def gpu_inputs(c: dict, dtype: torch.dtype):
    """(q, cache, block_tables, seq_lens) on CUDA: used blocks shuffled, the rest of the cache NaN, unread
    block-table entries garbage (-1, N, 2**30)."""
    gen = torch.Generator(device="cuda").manual_seed(c["seed"])
    page, hkv, d, lens = c["page"], c["hkv"], c["d"], c["lens"]
    need = [-(-n // page) for n in lens]
    nb = sum(need) + 3
    m = max(need) + c["spare_cols"]
    perm = torch.randperm(nb, generator=gen, device="cuda").to(torch.int32)
    garbage = torch.tensor([-1, nb, 2**30], dtype=torch.int32, device="cuda")
    table = garbage[torch.randint(0, 3, (len(lens), m), generator=gen, device="cuda")]
    starts = [0]
    for n in need:
        starts.append(starts[-1] + n)
    for s, n in enumerate(need):
        table[s, :n] = perm[starts[s] : starts[s] + n]
    shape = (nb, 2, page, hkv, d) if c["layout"] == "NHD" else (nb, 2, hkv, page, d)
    cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    view = cache if c["layout"] == "NHD" else cache.transpose(2, 3)  # [N, 2, P, Hkv, D] view
    for s, n in enumerate(lens):
        t = torch.arange(n, device="cuda")
        blk, off = table[s, t // page].long(), t % page
        view[blk, :, off] = torch.randn(n, 2, hkv, d, generator=gen, device="cuda", dtype=F64).to(dtype)
    q = torch.randn(len(lens), hkv * c["ratio"], d, generator=gen, device="cuda", dtype=F64).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def oracle(q, cache, table, lens, layout, scale=None) -> torch.Tensor:
    """float64 decode attention, one sequence at a time: K/V gathered by slot arithmetic (block
    ``table[s, t // P]``, offset ``t % P``); query head h reads KV head h // (Hq / Hkv)."""
    b, hq, d = q.shape
    view = cache if layout == "NHD" else cache.transpose(2, 3)
    page, hkv = view.shape[2], view.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(b, hq, d, dtype=F64, device=q.device)
    for s, n in enumerate(lens.tolist()):
        t = torch.arange(n, device=q.device)
        kv = view[table[s, t // page].long(), :, t % page].to(F64)  # [n, 2, Hkv, D]
        k = kv[:, 0].repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = kv[:, 1].repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[s].to(F64), k) * scale, dim=-1)
        out[s] = torch.einsum("hn,nhd->hd", w, v)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_seeded_cases_match_float64_oracle(dtype):
    failures = []
    for seed in range(CASES_PER_DTYPE):
        c = gpu_case(seed)
        q, cache, table, lens = gpu_inputs(c, dtype)
        out = tp.paged_decode(q, cache, table, lens, c["scale"], c["layout"])
        msg = mismatch(out, oracle(q, cache, table, lens, c["layout"], c["scale"]), dtype, f"case {c}")
        if msg:
            failures.append(msg)
    assert not failures, f"{len(failures)} of {CASES_PER_DTYPE} cases failed:\n" + "\n".join(failures[:5])


def test_float32_and_forced_splits():
    failures = []
    for seed in range(24):
        c = gpu_case(1000 + seed)
        q, cache, table, lens = gpu_inputs(c, torch.float32)
        ref = oracle(q, cache, table, lens, c["layout"], c["scale"])
        for splits in (None, 1, 7, 32):
            out = tp.paged_decode(q, cache, table, lens, c["scale"], c["layout"], num_splits=splits)
            msg = mismatch(out, ref, torch.float32, f"splits={splits} case {c}")
            if msg:
                failures.append(msg)
    assert not failures, "\n".join(failures[:5])


def test_small_batch_long_context_uses_splits():
    """B=1, Hkv=8, 32768 keys: at least 16 splits so the stage-1 grid covers the SMs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, splits = tp.choose_split_len(1, 8, 32768, sms, 64)
    kn = tp.PagedDecodeKnobs()
    assert splits >= min(kn.max_splits, math.ceil(kn.waves * sms / 8)) and splits >= 16


def _decode_inputs(dtype=torch.bfloat16, seed=0, layout="NHD"):
    c = dict(
        seed=seed,
        page=16,
        layout=layout,
        d=128,
        hkv=8,
        ratio=4,
        lens=[1, 700, 4096, 33, 2048, 1, 5, 4000],
        spare_cols=2,
        scale=None,
    )
    return gpu_inputs(c, dtype)


@pytest.fixture
def prefer_triton():
    """flashinfer.paged_attention (priority 60) outranks triton.paged_decode (40) when FlashInfer is
    installed: prefer ours inside these tests so they exercise it either way."""
    with lz.prefer(tp.KERNEL_ID):
        yield


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_chosen_and_served_by_lz_paged_attention(layout, prefer_triton):
    q, cache, table, lens = _decode_inputs(layout=layout)
    assert lz.which("paged_attention", q, cache, table, lens, kv_layout=layout) == tp.KERNEL_ID
    with lz.trace() as t:
        out = lz.paged_attention(q, cache, table, lens, kv_layout=layout)
    assert t.kernels_for("paged_attention") == [tp.KERNEL_ID] and not t.fallbacks
    msg = mismatch(out, oracle(q, cache, table, lens, layout), torch.bfloat16, layout)
    assert msg is None, msg
    # prefill/append is refused with the reason and served by another kernel
    cu = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.int32, device="cuda")
    report = lz.explain("paged_attention", q, cache, table, lens, cu_seqlens_q=cu, kv_layout=layout)
    assert report.chosen != tp.KERNEL_ID
    assert "decode only" in str(report.candidate(tp.KERNEL_ID).reasons)


def test_cuda_graph_capture_replays_decode(prefer_triton):
    q, cache, table, lens = _decode_inputs(seed=1)
    assert lz.warmup("paged_attention", [((q, cache, table, lens), {})]) == [tp.KERNEL_ID]
    assert lz.is_graph_safe("paged_attention", q, cache, table, lens)

    def step(q, cache, table, lens):
        return lz.paged_attention(q, cache, table, lens)

    check = lz.validate_graph_capture(step, q, cache, table, lens)
    assert check.ok, str(check)
    assert check.kernels == (f"paged_attention:{tp.KERNEL_ID}",)
    assert RUNTIME.registry.kernel(tp.KERNEL_ID, "paged_attention").graph_safe


def test_graph_replay_follows_new_lengths_and_tables():
    """Capture once, then change seq_lens and block_tables in place (same shapes): the replay reads the new
    values on the device (no host read was frozen into the graph): replay == eager == oracle of the new
    inputs. The cache's NaN are zeroed first so that any valid block id gives a finite oracle."""
    q, cache, table, lens = _decode_inputs(torch.float16, seed=2)
    cache.nan_to_num_(0.0)
    lz.warmup("paged_attention", [((q, cache, table, lens), {})])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lz.paged_attention(q, cache, table, lens)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = lz.paged_attention(q, cache, table, lens)
    g.replay()
    torch.cuda.synchronize()
    assert mismatch(static_out, oracle(q, cache, table, lens, "NHD"), torch.float16) is None
    gen = torch.Generator(device="cuda").manual_seed(5)
    cap = table.shape[1] * 16
    lens.copy_(torch.randint(1, cap + 1, lens.shape, generator=gen, device="cuda", dtype=torch.int32))
    table.copy_(
        torch.randint(0, cache.shape[0], table.shape, generator=gen, device="cuda", dtype=torch.int32)
    )
    g.replay()
    torch.cuda.synchronize()
    eager = tp.paged_decode(q, cache, table, lens)  # eager: the fused split merge
    assert mismatch(eager, oracle(q, cache, table, lens, "NHD"), torch.float16) is None
    assert mismatch(static_out, eager.to(F64), torch.float16) is None
    with lz.capture_selection():  # eager calls as captured: the graph's two-kernel merge, its bits
        as_captured = tp.paged_decode(q, cache, table, lens)
    assert torch.equal(static_out, as_captured)  # same kernels, same split plan, deterministic


def _poison_workspace(q: torch.Tensor, splits: int) -> None:
    """Free a NaN block of the split workspace's size, so the caching allocator hands it to the next call: a
    merge that read a partial before its split stored it would then read NaN, not last call's equal values."""
    b, hq, d = q.shape
    torch.full((b * hq * splits * (d + 1),), float("nan"), dtype=torch.float32, device=q.device)


def test_fused_split_merge_matches_and_never_reads_early(monkeypatch):
    """The split that counts last merges (the ``fused_merge`` knob, one launch) from partials other SMs wrote
    in the same launch: a missing release/acquire or a stale L1 read would merge NaN (the workspace is
    poisoned before each launch) or last launch's values. 120 seeded cases with 2..32 splits, each launched 3
    times back to back without a sync (the counters must be back at 0 before the next launch): every launch
    equals the first bit for bit and, as the two-kernel merge, matches the float64 oracle (the two forms may
    round the last bit differently); then a CUDA graph (two kernels under capture) replayed 20 times into a
    NaN-filled output equals an eager call under ``lz.capture_selection`` bit for bit, and two streams launch
    the fused form at once (each has its own counters)."""
    with knobs(tp.KNOBS, fused_merge=True):  # every eager call below (plans dropped on entry and exit)
        _fused_split_merge_matches_and_never_reads_early(monkeypatch)


def _fused_split_merge_matches_and_never_reads_early(monkeypatch):
    failures = []
    for seed in range(120):
        c = gpu_case(3000 + seed)
        q, cache, table, lens = gpu_inputs(c, torch.bfloat16)
        cache.nan_to_num_(0.0)
        splits = (2, 3, 7, 16, 32)[seed % 5]
        with knobs(tp.KNOBS, fused_merge=False):
            two = tp.paged_decode(q, cache, table, lens, c["scale"], c["layout"], num_splits=splits)
        outs = []
        for _ in range(3):
            _poison_workspace(q, splits)
            outs.append(tp.paged_decode(q, cache, table, lens, c["scale"], c["layout"], num_splits=splits))
        torch.cuda.synchronize()
        ref = oracle(q, cache, table, lens, c["layout"], c["scale"])
        for i, out in enumerate(outs):
            msg = mismatch(out, ref, torch.bfloat16, f"fused launch {i}, splits {splits}, case {c}")
            if msg or not torch.equal(out, outs[0]):
                failures.append(msg or f"fused launch {i} differs from launch 0 in {c}")
        msg = mismatch(two, ref, torch.bfloat16, f"two-kernel merge, splits {splits}, case {c}")
        if msg:  # the same merge code in both forms, rounded alike up to the last bit (layouts may differ)
            failures.append(msg)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:5])
    q, cache, table, lens = gpu_inputs(gpu_case(3500), torch.bfloat16)
    cache.nan_to_num_(0.0)
    with lz.capture_selection():  # eager calls as captured: the two-kernel merge a graph replays
        want = tp.paged_decode(q, cache, table, lens, num_splits=16)
    fused = tp.paged_decode(q, cache, table, lens, num_splits=16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tp.paged_decode(q, cache, table, lens, num_splits=16)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    launches: list[str] = []
    real = tpl.launch_pinned
    monkeypatch.setattr(
        tpl,
        "launch_pinned",
        lambda fn, pin, grid, *a, **k: (launches.append(fn.__name__), real(fn, pin, grid, *a, **k)),
    )
    with torch.cuda.graph(g):
        static = tp.paged_decode(q, cache, table, lens, num_splits=16)
    monkeypatch.setattr(tpl, "launch_pinned", real)
    assert launches == [
        "paged_decode_split",
        "paged_decode_merge",
    ]  # graphs keep the two kernels (faster replayed)
    for _ in range(20):
        static.fill_(float("nan"))  # a replay whose counters were not back at 0 would merge nothing
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want)
    streams = [torch.cuda.Stream() for _ in range(2)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    for _ in range(5):
        for s in streams:
            with torch.cuda.stream(s):
                results.append(tp.paged_decode(q, cache, table, lens, num_splits=16))
    torch.cuda.synchronize()
    assert all(torch.equal(r, fused) for r in results)
