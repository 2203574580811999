"""Cascade attention's building blocks on CPU: ``lz.paged_attention(..., return_lse=True)`` and
``lz.merge_attention_states`` through dispatch, and the Triton kernels (``triton.paged_decode_lse``,
``triton.paged_prefill_lse``, ``triton.merge_attention_states``) under the Triton interpreter.

Oracle: float64 attention written here, independent of the kernels: each sequence's keys gathered token by
token through its block table, scores masked by hand (bottom-right causal or none), ``torch.logsumexp`` for
the lse. Seeded ragged batches (empty sequences, q_len 1..6, KV up to ~60 tokens), GQA 1..4, NHD and HND, page
sizes 1..16, odd head dims. Plus the cascade identity the engine relies on (attention over a prefix + a
suffix, merged, equals attention over the whole sequence), the merge worked out by hand, its -inf rows, and
bad inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch
from _triton_interp import needs_interpreter

import layerzero as lz
from layerzero.core.errors import InvalidInputError

pytestmark = pytest.mark.correctness
interpreted = needs_interpreter("tests/gpu/test_gpu_cascade.py")


def case(
    seed: int, layout: str = "NHD", dtype=torch.float32, decode: bool = False, head_dim: int | None = None
):
    """(q, cache, block_tables, seq_lens, cu_seqlens_q or None): a seeded ragged batch in a random block pool
    (``head_dim`` forces D)."""
    rnd = random.Random(seed)
    hkv, group, d, page = (
        rnd.choice([1, 2, 3]),
        rnd.choice([1, 2, 4]),
        rnd.choice([8, 20, 32]),
        rnd.choice([1, 3, 16]),
    )
    d = head_dim or d
    b = rnd.randint(1, 4)
    q_lens = [1] * b if decode else [rnd.choice([0, 1, 2, 6]) for _ in range(b)]
    kv_lens = [ql + rnd.randint(1 if decode else 0, 60) for ql in q_lens]
    width = max(1, max(-(-k // page) for k in kv_lens))
    blocks = b * width + 3
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, 2, page, hkv, d) if layout == "NHD" else (blocks, 2, hkv, page, d)
    cache = torch.randn(shape, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: b * width].view(b, width).to(torch.int32)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=g).to(dtype)
    cu = None if decode else torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, cache, tables, torch.tensor(kv_lens, dtype=torch.int32), cu


def oracle(q, cache, tables, seq_lens, cu, layout="NHD", causal=True, scale=None):
    """float64 ``(out [T, Hq, D], lse [T, Hq])`` written from the definition."""
    t, hq, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    nhd = cache if layout == "NHD" else cache.transpose(2, 3)
    page, hkv = nhd.shape[2], nhd.shape[3]
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    lse = torch.full((t, hq), -math.inf, dtype=torch.float64)
    starts = cu.tolist() if cu is not None else list(range(len(seq_lens) + 1))
    for s, kv_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        keys = (
            torch.stack([nhd[tables[s, p // page], 0, p % page] for p in range(kv_len)]) if kv_len else None
        )
        vals = (
            torch.stack([nhd[tables[s, p // page], 1, p % page] for p in range(kv_len)]) if kv_len else None
        )
        for i in range(q1 - q0):
            for h in range(hq):
                kh = h // (hq // hkv)
                seen = kv_len - (q1 - q0) + i + 1 if causal else kv_len
                if seen <= 0:
                    continue
                sc = (keys[:seen, kh].double() @ q[q0 + i, h].double()) * scale
                lse[q0 + i, h] = torch.logsumexp(sc, 0)
                out[q0 + i, h] = torch.softmax(sc, 0) @ vals[:seen, kh].double()
    return out, lse


TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_return_lse_matches_the_float64_oracle(seed, causal, layout):
    q, cache, tables, lens, cu = case(seed, layout)
    out, lse = lz.paged_attention(
        q, cache, tables, lens, cu_seqlens_q=cu, is_causal=causal, kv_layout=layout, return_lse=True
    )
    ref_out, ref_lse = oracle(q, cache, tables, lens, cu, layout, causal)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    close(out, ref_out, torch.float32)
    close(lse, ref_lse, torch.float32)
    plain = lz.paged_attention(q, cache, tables, lens, cu_seqlens_q=cu, is_causal=causal, kv_layout=layout)
    torch.testing.assert_close(plain, out, rtol=2e-5, atol=2e-5)  # return_lse changes nothing else


def test_cascade_identity_prefix_plus_suffix_is_the_whole_sequence():
    """What the engine computes: decode queries over a shared prefix (not causal, one "sequence" per group)
    and over each sequence's own blocks, merged, equal attention over each whole sequence."""
    g = torch.Generator().manual_seed(5)
    page, hkv, hq, d = 4, 2, 4, 16
    cache = torch.randn(40, 2, page, hkv, d, generator=g)
    prefix = [3, 17, 9]  # 3 shared blocks = 12 tokens
    own = [[5, 6], [21], [30, 31, 32]]
    lens = torch.tensor([12 + 6, 12 + 1, 12 + 10], dtype=torch.int32)
    full = torch.zeros(3, 6, dtype=torch.int32)
    suffix = torch.zeros(3, 3, dtype=torch.int32)
    for s, blocks in enumerate(own):
        full[s, : 3 + len(blocks)] = torch.tensor(prefix + blocks)
        suffix[s, : len(blocks)] = torch.tensor(blocks)
    q = torch.randn(3, hq, d, generator=g)
    whole, whole_lse = lz.paged_attention(q, cache, full, lens, return_lse=True)
    shared, shared_lse = lz.paged_attention(
        q,
        cache,
        torch.tensor([prefix], dtype=torch.int32),
        torch.tensor([12], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
        is_causal=False,
        return_lse=True,
    )
    mine, mine_lse = lz.paged_attention(q, cache, suffix, lens - 12, return_lse=True)
    merged, merged_lse = lz.merge_attention_states(shared, shared_lse, mine, mine_lse)
    torch.testing.assert_close(merged, whole, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(merged_lse, whole_lse, rtol=2e-5, atol=2e-5)
    ref, ref_lse = oracle(q, cache, full, lens, None)
    close(merged, ref, torch.float32)
    close(merged_lse, ref_lse, torch.float32)


def test_merge_by_hand_and_its_infinite_rows():
    # equal lse: the mean, lse + log 2; one side -inf: the other state; both -inf: 0 and -inf, even over NaN
    # rows
    oa = torch.tensor([[[1.0, 3.0]], [[5.0, 5.0]], [[float("nan"), 1.0]], [[2.0, 2.0]]])
    ob = torch.tensor([[[3.0, -1.0]], [[7.0, 9.0]], [[4.0, 6.0]], [[float("nan"), 0.0]]])
    la = torch.tensor([[0.5], [-math.inf], [-math.inf], [-math.inf]])
    lb = torch.tensor([[0.5], [2.0], [1.0], [-math.inf]])
    out, lse = lz.merge_attention_states(oa, la, ob, lb)
    assert out.tolist() == [[[2.0, 1.0]], [[7.0, 9.0]], [[4.0, 6.0]], [[0.0, 0.0]]]
    assert lse[0, 0].item() == pytest.approx(0.5 + math.log(2))
    assert lse[1:, 0].tolist() == [2.0, 1.0, -math.inf]
    # unequal weights: exp(1) : exp(0)
    out, lse = lz.merge_attention_states(
        torch.ones(1, 1, 1), torch.ones(1, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1)
    )
    assert out.item() == pytest.approx(math.e / (math.e + 1)) and lse.item() == pytest.approx(
        math.log(math.e + 1)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_merge_matches_float64(dtype):
    g = torch.Generator().manual_seed(3)
    oa, ob = (torch.randn(7, 3, 20, generator=g).to(dtype) for _ in range(2))
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    la, lb = (torch.randn(7, 3, generator=g).to(lse_dtype) * 4 for _ in range(2))
    out, lse = lz.merge_attention_states(oa, la, ob, lb)
    wa, wb = la.double().exp(), lb.double().exp()
    ref = (oa.double() * wa[..., None] + ob.double() * wb[..., None]) / (wa + wb)[..., None]
    assert out.dtype == dtype and lse.dtype == lse_dtype
    tol = 1e-12 if dtype == torch.float64 else TOL.get(dtype, (1e-5, 1e-5))[0]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), (wa + wb).log(), rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise_typed_errors():
    q, cache, tables, lens, cu = case(0)
    with pytest.raises(InvalidInputError, match="return_lse"):
        lz.paged_attention(q, cache, tables, lens, cu_seqlens_q=cu, return_lse=1)
    o, l_ = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(InvalidInputError, match="out_b shape"):
        lz.merge_attention_states(o, l_, torch.zeros(2, 3, 5), l_)
    with pytest.raises(InvalidInputError, match="lse_a shape"):
        lz.merge_attention_states(o, torch.zeros(2, 4), o, l_)
    with pytest.raises(InvalidInputError, match="lse_b.dtype"):
        lz.merge_attention_states(o, l_, o, l_.half())
    with pytest.raises(InvalidInputError, match="lse dtype"):
        lz.merge_attention_states(o, l_.double(), o, l_.double())
    with pytest.raises(InvalidInputError, match="out_b.dtype"):
        lz.merge_attention_states(o, l_, o.half(), l_)
    with pytest.raises(InvalidInputError, match="is_causal"):  # the shared checks of lz.paged_attention run
        lz.paged_attention(q, cache, tables, lens, cu_seqlens_q=cu, is_causal=None, return_lse=True)


# ------------------------------------------------------------------------------------ Triton, interpreted
@interpreted
@pytest.mark.parametrize("seed", range(3))  # both layouts (by the seed's parity); 3 seeds: CI's time budget
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_paged_prefill_lse(seed, causal, splits):
    from layerzero.backends.triton.cascade import paged_prefill_lse

    layout = "NHD" if seed % 2 else "HND"
    q, cache, tables, lens, cu = case(seed, layout)
    out, lse = paged_prefill_lse(
        q, cache, tables, lens, cu, None, causal, layout, num_splits=splits, block_n=16
    )
    ref_out, ref_lse = oracle(q, cache, tables, lens, cu, layout, causal)
    close(out, ref_out, torch.float32)
    close(lse, ref_lse, torch.float32)


@interpreted
@pytest.mark.parametrize("seed", range(2))  # both layouts
@pytest.mark.parametrize("causal", [True, False])
def test_triton_paged_prefill(seed, causal):
    """``triton.paged_prefill`` (op ``paged_attention``, the prefill kernel without its lse): mixed prefill /
    append / decode rows with the default sizing, as an engine's eager steps call it."""
    from layerzero.backends.triton.cascade import paged_prefill

    layout = "HND" if seed % 2 else "NHD"
    q, cache, tables, lens, cu = case(seed + 100, layout)
    out = paged_prefill(q, cache, tables, lens, cu, None, causal, layout)
    close(out, oracle(q, cache, tables, lens, cu, layout, causal)[0], torch.float32)


@interpreted
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"block_n": 16, "min_split_tiles": 1},
        {"block_n": 16, "min_split_tiles": 1, "target": 1000},
        {"rows": 64},
    ],
    ids=["default", "device-split", "many-splits", "rows64"],
)
def test_triton_paged_prefill_lse_shared_level(seed, knobs):
    """Cascade's shared level as the engine's decode graphs call it: one "sequence" per batch row (T = B), the
    groups first (1..9 members: more than one 16-row tile at GQA 2), then empty ones (no rows, no keys), not
    causal. The kernel finds its work items and sizes its splits on the device; every row must match the
    oracle (rows of no group: none here, every row is some group's member)."""
    from layerzero.backends.triton.cascade import paged_prefill_lse

    rnd = random.Random(100 + seed)
    hkv, group, d, page = 2, 2, 32, rnd.choice([4, 16])
    members = [rnd.randint(1, 9) for _ in range(rnd.randint(1, 4))]
    b = sum(members)
    prefix = [rnd.randint(1, 90) for _ in members] + [0] * (b - len(members))
    width = max(-(-n // page) for n in prefix)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(b * width + 2, 2, page, hkv, d, generator=g)
    tables = torch.randperm(b * width + 2, generator=g)[: b * width].view(b, width).to(torch.int32)
    q = torch.randn(b, hkv * group, d, generator=g)
    cu = torch.tensor(
        [0, *torch.tensor(members).cumsum(0).tolist()] + [b] * (b - len(members)), dtype=torch.int32
    )
    lens = torch.tensor(prefix, dtype=torch.int32)
    out, lse = paged_prefill_lse(q, cache, tables, lens, cu, None, False, "NHD", **knobs)
    ref_out, ref_lse = oracle(q, cache, tables, lens, cu, "NHD", causal=False)
    close(out, ref_out, torch.float32)
    close(lse, ref_lse, torch.float32)


def test_per_sequence_vector_width_is_one_compiled_kernel_up_to_256_sequences():
    """``B_PAD`` (the kernel's per-sequence vector width) is a compile-time constant: ``seq_pad`` keeps it at
    256 for every batch of 1..256 sequences (one compiled kernel where ``next_pow2(B)`` made five), then the
    next power of two, never above ``MAX_SEQS``; the launch passes it (a spy on the launch, under the
    interpreter when present)."""
    from layerzero.backends.triton import cascade

    assert [cascade.seq_pad(b) for b in (1, 3, 16, 17, 200, 256)] == [256] * 6
    assert [cascade.seq_pad(b) for b in (257, 600, cascade.MAX_SEQS)] == [512, 1024, cascade.MAX_SEQS]
    if interpreted.args[0]:
        return
    seen = []
    real = cascade.launch

    def spy(fn, grid, *args, **kw):
        if "B_PAD" in kw:
            seen.append(kw["B_PAD"])
        return real(fn, grid, *args, **kw)

    cascade.launch = spy
    try:
        for seed in (0, 1):
            q, cache, tables, lens, cu = case(seed, "NHD")
            cascade.paged_prefill_lse(q, cache, tables, lens, cu, None, True, "NHD", num_splits=1, block_n=16)
    finally:
        cascade.launch = real
    assert seen and set(seen) == {256}


def test_triton_paged_prefill_lse_refuses_too_many_sequences():
    """Every program holds per-sequence vectors of seq_pad(B) entries: more than MAX_SEQS sequences are
    refused by the check (a typed reason) and by the kernel entry (a typed error, before any launch)."""
    from types import SimpleNamespace

    from layerzero.backends.triton import cascade

    ctx = SimpleNamespace(gqa_ratio=2, kv_layout="NHD", page_size=16, batch=cascade.MAX_SEQS)
    assert cascade.prefill_check(ctx) == []
    reasons = cascade.prefill_check(SimpleNamespace(**{**vars(ctx), "batch": cascade.MAX_SEQS + 1}))
    assert [r.code.name for r in reasons] == ["SHAPE_MISMATCH"] and "2049 sequences" in reasons[0].message
    if interpreted.args[0]:  # no triton / interpreter here: the entry's guard is not reachable
        return
    b = cascade.MAX_SEQS + 1
    q, cache = torch.zeros(b, 2, 8), torch.zeros(1, 2, 4, 1, 8)
    tables, lens = torch.zeros(b, 1, dtype=torch.int32), torch.zeros(b, dtype=torch.int32)
    with pytest.raises(InvalidInputError, match="sequences"):
        cascade.paged_prefill_lse(q, cache, tables, lens, None, None, False, "NHD")


@interpreted
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_paged_decode_lse(seed, splits):
    from layerzero.backends.triton.paged import paged_decode

    q, cache, tables, lens, _ = case(seed, "NHD", decode=True)
    out, lse = paged_decode(q, cache, tables, lens, num_splits=splits, block_n=16, return_lse=True)
    ref_out, ref_lse = oracle(q, cache, tables, lens, None)
    close(out, ref_out, torch.float32)
    close(lse, ref_lse, torch.float32)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_merge(dtype):
    from layerzero.backends.reference.paged import merge_attention_states as ref_merge
    from layerzero.backends.triton.cascade import merge_attention_states

    g = torch.Generator().manual_seed(4)
    oa, ob = (torch.randn(5, 6, 24, generator=g).to(dtype) for _ in range(2))
    la, lb = (torch.randn(5, 6, generator=g) * 3 for _ in range(2))
    la[0], lb[0], la[1, 2], oa[1, 2] = -math.inf, -math.inf, -math.inf, float("nan")
    out, lse = merge_attention_states(oa[:, :, :20], la, ob[:, :, :20], lb)  # strided rows (D 20 of 24)
    ref, ref_lse = ref_merge(oa[:, :, :20], la, ob[:, :, :20], lb)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(torch.isneginf(lse[0]).all())
    close(out, ref.double(), dtype)
    torch.testing.assert_close(lse, ref_lse)


def test_non_causal_rows_may_outnumber_keys_and_keys_may_be_absent():
    """Without a causal mask a sequence may have more query tokens than keys, or no key at all (cascade
    attention's groups of one with an empty prefix): those rows are 0 with lse -inf, and the others match the
    oracle; a causal call with q_len > seq_len is still refused."""
    g = torch.Generator().manual_seed(9)
    cache = torch.randn(6, 2, 4, 2, 16, generator=g)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    lens = torch.tensor([3, 0, 5], dtype=torch.int32)
    cu = torch.tensor([0, 4, 6, 7], dtype=torch.int32)  # 4 queries over 3 keys, 2 over none, 1 over 5
    q = torch.randn(7, 4, 16, generator=g)
    out, lse = lz.paged_attention(q, cache, tables, lens, cu_seqlens_q=cu, is_causal=False, return_lse=True)
    ref, ref_lse = oracle(q, cache, tables, lens, cu, causal=False)
    close(out, ref, torch.float32)
    assert torch.equal(out[4:6], torch.zeros(2, 4, 16)) and bool(torch.isneginf(lse[4:6]).all())
    torch.testing.assert_close(lse[[0, 1, 2, 3, 6]].double(), ref_lse[[0, 1, 2, 3, 6]], rtol=2e-5, atol=2e-5)
    with pytest.raises(InvalidInputError, match="q_len"):
        lz.paged_attention(q, cache, tables, lens, cu_seqlens_q=cu, is_causal=True)


def test_one_query_token_with_cu_seqlens_is_not_a_decode_call():
    """A call with cu_seqlens_q is never phase DECODE, even with one token (cascade's shared level at batch 1
    in a CUDA graph): decode-only kernels, which ignore cu_seqlens_q, must not be picked for it."""
    from layerzero.core.specs import Phase
    from layerzero.ops import OPS

    q, cache, tables, lens, _ = case(1, decode=True)
    for op in ("paged_attention", "paged_attention_lse"):
        prepare, context = OPS[op]
        key, _ = prepare(
            q[:1], cache, tables[:1], lens[:1], cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32)
        )
        assert context(key).phase is Phase.PREFILL
        key, _ = prepare(q[:1], cache, tables[:1], lens[:1])
        assert context(key).phase is Phase.DECODE
