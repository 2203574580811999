"""``lz.paged_attention`` / ``lz.reshape_and_cache`` kernels against a float64 oracle written here.

Every paged_attention kernel available on this CPU (``lz.list_kernels``), locked, runs >= 200 seeded cases per
dtype (fp32, bf16, fp16): page sizes {1, 8, 16, 32}, NHD and HND, GQA ratios 1/2/4/8, decode and append
(prefill with q_len == kv_len, chunks with q_len < kv_len, empty and length-1 sequences), custom scales. The
cache starts as all-NaN; only the slots the sequences use get values, so NaN sits in every unused page and in
the tail of every last page, and unread block_tables entries hold garbage ids (-1, out of range): none of it
may reach the output. The oracle materializes each sequence's K/V from the cache token by token (slot
arithmetic by hand) and computes softmax attention in float64 with bottom-right causal alignment.
reshape_and_cache: round trips per kernel (bitwise), -1 slots untouched, and a prefill + decode serving loop
against full causal attention.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import layerzero as lz

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shapes import dname, mismatch, skip_if_off_on_this_cpu  # noqa: E402

pytestmark = pytest.mark.correctness

F64 = torch.float64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAGE_SIZES = (1, 8, 16, 32)
RATIOS = (1, 2, 4, 8)
MIN_CASES = 200
BROAD = {"reference.paged_attention", "torch_sdpa.paged_attention"}
CACHE_KERNELS = ("reference.reshape_and_cache", "torch_native.reshape_and_cache")


# ------------------------------------------------------------------------------------------ cases
@dataclass(frozen=True, slots=True)
class PagedCase:
    """One paged_attention call: per-sequence (q_len, kv_len), decode (cu_seqlens_q None) or append."""

    seed: int
    layout: str
    page: int
    hkv: int
    ratio: int
    d: int
    lens: tuple[tuple[int, int], ...]  # (q_len, kv_len) per sequence
    decode: bool
    causal: bool
    scale: float | None
    spare_blocks: int
    spare_cols: int


def paged_case(seed: int) -> PagedCase:
    """The seeded case ``seed``: cycles layouts, page sizes, GQA ratios and decode/append so every combination
    appears within the first 200 seeds; lengths include 0 (empty, append only), 1, q_len == kv_len."""
    rng = random.Random(seed * 7919 + 11)
    decode = seed % 2 == 0
    lens = []
    for _ in range(rng.randint(1, 4)):
        kv = rng.choice((1, 1, 2, rng.randint(1, 9), rng.randint(1, 40), rng.randint(30, 70)))
        if decode:
            lens.append((1, kv))
            continue
        kind = rng.random()
        if kind < 0.15:
            lens.append((0, 0))  # empty sequence
        elif kind < 0.45:
            lens.append((kv, kv))  # prefill
        else:
            lens.append((rng.randint(0 if kind < 0.55 else 1, kv), kv))  # append a chunk (maybe none)
    return PagedCase(
        seed,
        ("NHD", "HND")[(seed // 2) % 2],
        PAGE_SIZES[(seed // 4) % 4],
        rng.choice((1, 2)),
        RATIOS[(seed // 16) % 4],
        rng.choice((4, 8, 13, 32, 64)),
        tuple(lens),
        decode,
        rng.random() < 0.85,
        rng.choice((None, None, 0.3, 1.7)),
        rng.randint(0, 3),
        rng.randint(0, 2),
    )


def _slot(cache: torch.Tensor, layout: str, block: int, offset: int, which: int) -> torch.Tensor:
    """The ``[Hkv, D]`` view of one token's K (which=0) or V (1), by the layout's definition."""
    return cache[block, which, offset] if layout == "NHD" else cache[block, which, :, offset]


@functools.lru_cache(maxsize=64)
def paged_inputs(seed: int, dtype: torch.dtype):
    """(q, kv_cache, block_tables, seq_lens, cu_seqlens_q or None) of case ``seed``; the cache is NaN except
    at the slots the sequences use, and unread block_tables entries hold garbage."""
    c = paged_case(seed)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-kv // c.page) for _, kv in c.lens]
    nb = sum(need) + c.spare_blocks
    ids = list(range(nb))
    rng.shuffle(ids)
    max_blocks = max(need) + c.spare_cols
    hq = c.hkv * c.ratio
    shape = (nb, 2, c.page, c.hkv, c.d) if c.layout == "NHD" else (nb, 2, c.hkv, c.page, c.d)
    cache = torch.full(shape, float("nan"), dtype=dtype)
    table = torch.tensor(
        [[rng.choice((-1, nb, nb + 7, 0)) for _ in range(max_blocks)] for _ in c.lens], dtype=torch.int32
    ).reshape(len(c.lens), max_blocks)
    for s, ((_, kv), n) in enumerate(zip(c.lens, need, strict=True)):
        for j in range(n):
            table[s, j] = ids.pop()
        for t in range(kv):
            for which in (0, 1):
                _slot(cache, c.layout, int(table[s, t // c.page]), t % c.page, which).copy_(
                    torch.randn(c.hkv, c.d, generator=gen, dtype=F64).to(dtype)
                )
    tokens = sum(q for q, _ in c.lens)
    q = torch.randn(tokens, hq, c.d, generator=gen, dtype=F64).to(dtype)
    seq_lens = torch.tensor([kv for _, kv in c.lens], dtype=torch.int32)
    cu = None
    if not c.decode:
        cu = torch.tensor([0, *itertools.accumulate([q for q, _ in c.lens])], dtype=torch.int32)
    return q, cache, table, seq_lens, cu


def paged_oracle(q, cache, table, seq_lens, cu, layout, scale, causal) -> torch.Tensor:
    """float64 paged attention: K/V of each sequence gathered token by token from its blocks (slot arithmetic
    by hand); query head h reads KV head h // (Hq / Hkv); query i of q_len attends keys j <= kv_len - q_len +
    i."""
    tokens, hq, d = q.shape
    page = cache.shape[2] if layout == "NHD" else cache.shape[3]
    lens = seq_lens.tolist()
    starts = cu.tolist() if cu is not None else list(range(len(lens) + 1))
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(tokens, hq, d, dtype=F64)
    for s, kv in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        slots = [(int(table[s, t // page]), t % page) for t in range(kv)]
        k = torch.stack([_slot(cache, layout, b, o, 0) for b, o in slots]).to(F64)  # [kv, Hkv, D]
        v = torch.stack([_slot(cache, layout, b, o, 1) for b, o in slots]).to(F64)
        heads = torch.arange(hq) // (hq // k.shape[1])
        k, v = k[:, heads], v[:, heads]  # [kv, Hq, D]
        ql = q1 - q0
        scores = torch.einsum("ihd,jhd->hij", q[q0:q1].to(F64), k) * scale
        if causal:
            visible = torch.arange(kv)[None, :] <= kv - ql + torch.arange(ql)[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v)
    return out


@functools.lru_cache(maxsize=64)
def _oracle(seed: int, dtype: torch.dtype) -> torch.Tensor:
    c = paged_case(seed)
    return paged_oracle(*paged_inputs(seed, dtype), c.layout, c.scale, c.causal)


# ------------------------------------------------------------------------------------------ paged_attention
PARAMS = [
    (k["kernel_id"], dt)
    for k in lz.list_kernels("paged_attention")
    for dt in DTYPES
    if k["available"] and "cpu" in k["device_types"] and dname(dt) in k["dtypes"]
]


def test_every_cpu_paged_kernel_is_covered():
    assert {kid for kid, _ in PARAMS} >= BROAD
    assert {dt for kid, dt in PARAMS if kid == "torch_sdpa.paged_attention"} == set(DTYPES)


def test_cases_cover_every_feature():
    """The first MIN_CASES seeds contain every page size x layout x GQA ratio x phase, empty, length-1 (decode
    and append), prefill (q_len == kv_len) and chunked append (0 < q_len < kv_len) sequences."""
    cases = [paged_case(s) for s in range(MIN_CASES)]
    combos = {(c.page, c.layout, c.ratio, c.decode) for c in cases}
    assert len(combos) == len(PAGE_SIZES) * 2 * len(RATIOS) * 2
    flat = [(c.decode, ql, kv) for c in cases for ql, kv in c.lens]
    assert any(not dec and kv == 0 for dec, _, kv in flat), "no empty sequence"
    assert any(dec and kv == 1 for dec, _, kv in flat) and any(
        not dec and kv == 1 == ql for dec, ql, kv in flat
    )
    assert any(not dec and 0 < ql < kv for dec, ql, kv in flat) and any(
        not dec and ql == kv > 1 for dec, ql, kv in flat
    )
    assert any(not c.causal for c in cases) and any(c.scale is not None for c in cases)
    assert any(any(kv % c.page for _, kv in c.lens) for c in cases if c.page > 1), (
        "no partly filled last page"
    )


@pytest.mark.parametrize(
    ("kernel_id", "dtype"), PARAMS, ids=lambda x: dname(x) if isinstance(x, torch.dtype) else x
)
def test_paged_kernel_matches_float64_oracle(kernel_id, dtype):
    """Locked kernel vs the float64 oracle on >= 200 seeded cases; NaN-poisoned unused pages/slots and garbage
    unread block_tables entries must not leak; every call traced to the kernel."""
    ran, failures, skipped = 0, [], {}
    lz.lock("paged_attention", kernel_id)
    try:
        with lz.trace() as tr:
            for seed in range(3 * MIN_CASES):
                if ran >= MIN_CASES:
                    break
                c = paged_case(seed)
                q, cache, table, seq_lens, cu = paged_inputs(seed, dtype)
                kw = dict(cu_seqlens_q=cu, scale=c.scale, is_causal=c.causal, kv_layout=c.layout)
                codes = [
                    r.code.value
                    for r in lz.validate(kernel_id, "paged_attention", q, cache, table, seq_lens, **kw)
                ]
                if codes:
                    for code in codes:
                        skipped[code] = skipped.get(code, 0) + 1
                    continue
                ran += 1
                before = cache.clone()
                out = lz.paged_attention(q, cache, table, seq_lens, **kw)
                msg = mismatch(out, _oracle(seed, dtype), dtype, f"{c}")
                if msg is None and out.numel() and not bool(torch.isfinite(out).all()):
                    msg = f"{c}: non-finite output"
                if msg is None and not torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0)):
                    msg = f"{c}: the kernel modified the cache"
                if msg:
                    failures.append(msg)
    finally:
        lz.unlock("paged_attention")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:8])
    assert tr.counts[("paged_attention", kernel_id)] == ran
    skip_if_off_on_this_cpu(kernel_id, ran, 3 * MIN_CASES if ran == 0 else 0, skipped)
    need = MIN_CASES if kernel_id in BROAD else 1
    assert ran >= need, f"only {ran} eligible cases; skipped {skipped}"


def test_output_dtype_shape_and_empty_batch():
    q, cache, table, seq_lens, cu = paged_inputs(1, torch.bfloat16)
    out = lz.paged_attention(q, cache, table, seq_lens, cu_seqlens_q=cu, kv_layout=paged_case(1).layout)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    empty = lz.paged_attention(
        torch.zeros(0, 4, 8),
        torch.zeros(1, 2, 4, 2, 8),
        torch.zeros(0, 3, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
    )
    assert empty.shape == (0, 4, 8)
    only_empty = lz.paged_attention(
        torch.zeros(0, 4, 8),
        torch.zeros(1, 2, 4, 2, 8),
        torch.full((2, 1), -1, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        cu_seqlens_q=torch.zeros(3, dtype=torch.int32),
    )
    assert only_empty.shape == (0, 4, 8)


def test_hand_worked_decode():
    """One KV head, D=1, page 2, keys [0, 0, ln 3] at tokens 0..2 (token 2 in the second block), values
    [1, 2, 10], q = 1, scale 1: weights 1:1:3 -> (1 + 2 + 30) / 5 = 6.6."""
    cache = torch.full((3, 2, 2, 1, 1), float("nan"))
    for t, (blk, off) in enumerate([(2, 0), (2, 1), (0, 0)]):
        cache[blk, 0, off] = (0.0, 0.0, math.log(3.0))[t]
        cache[blk, 1, off] = (1.0, 2.0, 10.0)[t]
    args = (
        torch.ones(1, 1, 1),
        cache,
        torch.tensor([[2, 0]], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
    )
    for kid in sorted(BROAD):
        with lz.trace() as tr:
            lz.lock("paged_attention", kid)
            out = lz.paged_attention(*args, scale=1.0)
            lz.unlock("paged_attention")
        assert tr.kernels_for("paged_attention") == [kid]
        assert out.item() == pytest.approx(6.6, rel=1e-6)


# ------------------------------------------------------------------------------------------ reshape_and_cache
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


@pytest.mark.parametrize("kernel_id", CACHE_KERNELS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_round_trip(kernel_id, layout, dtype):
    """Write tokens at random distinct slots (some -1): each written slot reads back bit-exactly as its input
    token (read by the layout's definition), every other element of the cache keeps its bits (NaN
    included)."""
    lz.lock("reshape_and_cache", kernel_id)
    try:
        for seed in range(12):
            rng = random.Random(seed)
            gen = torch.Generator().manual_seed(seed)
            nb, page, hkv, d = (
                rng.randint(1, 5),
                rng.choice(PAGE_SIZES),
                rng.choice((1, 2, 4)),
                rng.choice((3, 8)),
            )
            n = rng.randint(0, min(nb * page, 20))
            slots = rng.sample(range(nb * page), n)
            slots = [s if rng.random() < 0.75 else -1 for s in slots]
            cache = lz.allocate_kv_cache(nb, page, hkv, d, dtype, layout)
            cache.copy_(torch.randn(cache.shape, generator=gen))
            cache.view(-1)[torch.rand(cache.numel(), generator=gen) < 0.2] = float("nan")
            before = cache.clone()
            k, v = (torch.randn(n, hkv, d, generator=gen).to(dtype) for _ in range(2))
            idx = torch.tensor(slots, dtype=rng.choice((torch.int32, torch.int64)))
            with lz.trace() as tr:
                assert lz.reshape_and_cache(k, v, cache, idx, kv_layout=layout) is None
            assert tr.kernels_for("reshape_and_cache") == [kernel_id]
            expect = before.clone()
            for t, s in enumerate(slots):
                if s >= 0:
                    for which, src in ((0, k), (1, v)):
                        got = _slot(cache, layout, s // page, s % page, which)
                        assert torch.equal(_bits(got), _bits(src[t])), (seed, t, s, which)
                        _slot(expect, layout, s // page, s % page, which).copy_(src[t])
            assert torch.equal(_bits(cache), _bits(expect)), (
                f"seed {seed}: a slot other than the written ones changed"
            )
    finally:
        lz.unlock("reshape_and_cache")


@pytest.mark.parametrize("kernel_id", CACHE_KERNELS)
def test_all_skipped_slots_leave_cache_untouched(kernel_id):
    cache = torch.randn(2, 2, 4, 1, 8)
    before = cache.clone()
    with lz.trace():
        lz.lock("reshape_and_cache", kernel_id)
        lz.reshape_and_cache(torch.ones(3, 1, 8), torch.ones(3, 1, 8), cache, torch.full((3,), -1))
        lz.unlock("reshape_and_cache")
    assert torch.equal(cache, before)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_serving_loop_matches_full_causal_attention(layout):
    """Prefill a 2-token prompt and a 5-token prompt (chunked 3 + 2) through reshape_and_cache +
    paged_attention, then decode 3 steps: every output row equals the matching row of full causal attention
    over the whole sequence (float64), which pins down the bottom-right causal alignment."""
    gen = torch.Generator().manual_seed(3)
    hkv, hq, d, page = 2, 4, 8, 2
    total = [2 + 3, 5 + 3]
    qs = [torch.randn(n, hq, d, generator=gen, dtype=F64) for n in total]
    ks = [torch.randn(n, hkv, d, generator=gen, dtype=F64) for n in total]
    vs = [torch.randn(n, hkv, d, generator=gen, dtype=F64) for n in total]
    cache = lz.allocate_kv_cache(16, page, hkv, d, F64, layout)
    table = torch.tensor([[5, 1, 9, 3], [0, 7, 2, 11]], dtype=torch.int32)

    def slot(s, t):
        return int(table[s, t // page]) * page + t % page

    def step(spans):  # spans: per sequence (start, stop) of the new tokens
        toks = [(s, t) for s, (a, b) in enumerate(spans) for t in range(a, b)]
        pad = torch.full(
            (1, hkv, d), float("nan"), dtype=F64
        )  # a padding token (slot -1) must not be written
        k = torch.cat([torch.stack([ks[s][t] for s, t in toks]), pad])
        v = torch.cat([torch.stack([vs[s][t] for s, t in toks]), pad])
        lz.reshape_and_cache(k, v, cache, torch.tensor([slot(s, t) for s, t in toks] + [-1]), layout)
        q = torch.stack([qs[s][t] for s, t in toks])
        cu = torch.tensor([0, *itertools.accumulate([b - a for a, b in spans])], dtype=torch.int32)
        lens = torch.tensor([b for _, b in spans], dtype=torch.int32)
        decode = all(b - a == 1 for a, b in spans)
        out = lz.paged_attention(q, cache, table, lens, cu_seqlens_q=None if decode else cu, kv_layout=layout)
        return dict(zip(toks, out, strict=True))

    got = {}
    got.update(step([(0, 2), (0, 3)]))
    got.update(step([(2, 2), (3, 5)]))  # sequence 0 has no new tokens in this chunk
    for i in range(3):
        got.update(step([(2 + i, 3 + i), (5 + i, 6 + i)]))
    for s in range(2):
        k, v = ks[s].repeat_interleave(hq // hkv, 1), vs[s].repeat_interleave(hq // hkv, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            qs[s].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        for t in range(total[s]):
            torch.testing.assert_close(got[(s, t)], ref[t], rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernel_id", sorted(BROAD))
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_kernels_on_cuda(kernel_id, dtype):
    """The same seeded cases on CUDA (inputs moved from the CPU case), 100 per kernel and dtype."""
    failures = []
    lz.lock("paged_attention", kernel_id)
    try:
        for seed in range(100):
            c = paged_case(seed)
            q, cache, table, seq_lens, cu = (
                None if t is None else t.cuda() for t in paged_inputs(seed, dtype)
            )
            out = lz.paged_attention(
                q,
                cache,
                table,
                seq_lens,
                cu_seqlens_q=cu,
                scale=c.scale,
                is_causal=c.causal,
                kv_layout=c.layout,
            )
            torch.cuda.synchronize()
            msg = mismatch(out.cpu(), _oracle(seed, dtype), dtype, f"{c}")
            if msg:
                failures.append(msg)
    finally:
        lz.unlock("paged_attention")
    assert not failures, "\n".join(failures[:8])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_id", CACHE_KERNELS)
def test_reshape_and_cache_on_cuda_matches_cpu(kernel_id):
    cache = torch.randn(4, 2, 8, 2, 16)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3, -1, 17, 31, 0])
    ref = cache.clone()
    lz.reshape_and_cache(k, v, ref, slots)
    gpu = cache.cuda()
    lz.lock("reshape_and_cache", kernel_id)
    try:
        lz.reshape_and_cache(k.cuda(), v.cuda(), gpu, slots.cuda())
    finally:
        lz.unlock("reshape_and_cache")
    assert torch.equal(gpu.cpu(), ref)


@pytest.mark.gpu
def test_cuda_value_checks_only_in_strict_mode():
    """Out-of-range block ids on CUDA are caught in strict mode (a sync) and not read otherwise."""
    q, cache = torch.randn(1, 2, 8, device="cuda"), torch.zeros(2, 2, 4, 2, 8, device="cuda")
    bad = torch.tensor([[5]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([3], dtype=torch.int32, device="cuda")
    from layerzero.ops.paged import prepare

    prepare(q, cache, bad, lens)  # no value check, no error
    lz.configure(strict=True)
    with pytest.raises(lz.InvalidInputError, match=r"block_tables\[0, 0\]"):
        prepare(q, cache, bad, lens)
