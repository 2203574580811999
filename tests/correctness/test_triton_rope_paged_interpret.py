"""``triton.rope_paged_decode`` (``lz.rope_paged_attention`` for decode: q/k norm + RoPE + the KV write +
split-K paged attention in one kernel, then the merge) under Triton's interpreter on CPU tensors, against a
float64 oracle written out here: ragged decode batches, GQA groups, odd head dims, page sizes 1 / 4 / 16, both
KV layouts, with and without the QK-norm, half rotation and interleaved pairs, one and several splits, a
skipped (-1) slot. Compiled on a GPU by tests/gpu/test_gpu_rope_paged.py."""

from __future__ import annotations

import random

import pytest
import torch
from _triton_interp import needs_interpreter

import layerzero as lz
from layerzero.backends.triton import rope_paged as trp
from layerzero.core.knobs import knobs
from layerzero.core.kv_layout import KVLayout

pytestmark = [pytest.mark.correctness, needs_interpreter("tests/gpu/test_gpu_rope_paged.py")]
# the interpreter rounds float32 -> bfloat16 toward zero (test_fused_projections.py): twice bf16's usual bound
# there
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}


def norm_rope64(x, w, cos_row, sin_row, eps, interleaved):
    """float64 per-head RMSNorm (``w`` None: none) then RoPE of ``x`` ``[H, D]`` at one position's cos / sin
    ``[D]``."""
    x = x.double()
    if w is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    if interleaved:
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos_row.double() + rot * sin_row.double()


def oracle(q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens, scale, eps, interleaved, layout):
    """float64: the rotated k (rounded to the cache's dtype, as the kernels store it) and v written into a
    copy of the cache, then each sequence's one query over its positions ``0 .. len - 1`` through its
    block-table row. Returns ``(out [B, Hq, D] float64, expected cache)``."""
    nhd = cache if layout == "NHD" else cache.transpose(2, 3)
    want_cache = nhd.clone()
    b, hq, d = q.shape
    hkv = k.shape[1]
    page = nhd.shape[2]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i in range(b):
        p = int(pos[i])
        qr = norm_rope64(q[i], qw, cos[p], sin[p], eps, interleaved).to(q.dtype).double()
        kr = norm_rope64(k[i], kw, cos[p], sin[p], eps, interleaved).to(q.dtype)
        s = int(slots[i])
        if s >= 0:
            want_cache[s // page, 0, s % page] = kr
            want_cache[s // page, 1, s % page] = v[i]
        n = int(lens[i])
        blocks = bt[i, (torch.arange(n) // page)].long()
        keys = want_cache[blocks, 0, torch.arange(n) % page].double()  # [n, Hkv, D]
        vals = want_cache[blocks, 1, torch.arange(n) % page].double()
        for h in range(hq):
            kv = h // (hq // hkv)
            w = torch.softmax(keys[:, kv] @ qr[h] * scale, dim=0)
            out[i, h] = w @ vals[:, kv]
    return out, (want_cache if layout == "NHD" else want_cache.transpose(2, 3))


def case(seed, dtype, b, hq, hkv, d, page, layout, norm, interleaved, skip=False, width=6):
    """A decode batch: random lengths, each sequence's blocks scattered over the pool (``width`` blocks a
    row), the new token's slot taken from its block-table row (as an engine builds it); ``skip``: the middle
    sequence's slot is -1."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nblocks = b * width + 2
    lens = torch.tensor([rng.randint(1, width * page) for _ in range(b)], dtype=torch.int32)
    perm = torch.randperm(nblocks, generator=g)
    bt = perm[: b * width].view(b, width).to(torch.int32)
    slots = torch.tensor(
        [int(bt[i, (int(lens[i]) - 1) // page]) * page + (int(lens[i]) - 1) % page for i in range(b)]
    )
    if skip:
        slots[b // 2] = -1
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
    qw = (torch.rand(d, generator=g) + 0.5).to(dtype) if norm else None
    kw = (torch.rand(d, generator=g) + 0.5).to(dtype) if norm else None
    cos, sin = torch.randn(2, 64, d, generator=g).to(dtype).unbind(0)
    pos = torch.randint(0, 64, (b,), generator=g)
    cache = lz.allocate_kv_cache(nblocks, page, hkv, d, dtype, layout)
    cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    return q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens


def run(args, interleaved, layout, splits):
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    with knobs(trp.KNOBS, num_splits=splits):
        return trp.rope_paged_decode(
            q,
            k,
            v,
            qw,
            kw,
            cos,
            sin,
            cache,
            slots,
            pos,
            bt,
            lens,
            None,
            None,
            interleaved,
            KVLayout(layout),
            1e-6,
        )


CASES = [  # seed, dtype, b, hq, hkv, d, page, layout, norm, interleaved, splits, skip
    (0, torch.float32, 1, 16, 8, 128, 16, "NHD", True, False, None, False),
    (1, torch.float32, 3, 6, 3, 40, 4, "HND", True, False, 3, True),
    (2, torch.float16, 4, 4, 4, 64, 1, "NHD", False, True, 2, False),
    (3, torch.bfloat16, 2, 8, 2, 32, 16, "HND", True, True, 4, False),
    (4, torch.bfloat16, 5, 12, 4, 16, 4, "NHD", False, False, 1, True),
    (5, torch.float32, 2, 2, 1, 8, 4, "NHD", True, True, 2, False),
]


@pytest.mark.parametrize(
    ("seed", "dtype", "b", "hq", "hkv", "d", "page", "layout", "norm", "interleaved", "splits", "skip"),
    CASES,
    ids=lambda x: str(x).replace("torch.", ""),
)
def test_matches_float64_oracle_and_writes_the_new_kv(
    seed, dtype, b, hq, hkv, d, page, layout, norm, interleaved, splits, skip
):
    args = case(seed, dtype, b, hq, hkv, d, page, layout, norm, interleaved, skip)
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    want, want_cache = oracle(
        q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens, d**-0.5, 1e-6, interleaved, layout
    )
    got = run(args, interleaved, layout, splits)
    assert got.shape == (b, hq, d) and got.dtype == dtype
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= TOL[dtype], err
    # the written k went through the same float32 norm / rotation: within one rounding of the oracle's rounded
    # k
    diff = (cache.double() - want_cache.double()).abs().max().item()
    assert diff <= TOL[dtype] * 4 * want_cache.double().abs().max().item(), diff
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[[int(s) // page for s in slots if int(s) >= 0]] = False
    assert torch.equal(cache[untouched], want_cache[untouched]), "only the new tokens' blocks change"


def test_skipped_slot_reads_the_cache_and_writes_nothing():
    """A -1 slot (a padded row): nothing is written and that row attends over the cache as it is (its last
    position included, read from the pool, not from its own k / v)."""
    args = case(7, torch.float32, 3, 4, 2, 16, 4, "NHD", True, False, skip=True)
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    before = cache.clone()
    want, _ = oracle(q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens, 0.25, 1e-6, False, "NHD")
    got = run(args, False, "NHD", 2)
    torch.testing.assert_close(got[1].double(), want[1], rtol=2e-5, atol=2e-5)
    page = 4
    for i in (0, 2):
        s = int(slots[i])
        before[s // page, :, s % page] = cache[s // page, :, s % page]
    assert torch.equal(cache, before), "the skipped row wrote nothing"


def test_split_count_changes_rounding_only():
    """1, 2 and 5 splits of the same call agree to float32 rounding (the merge weights the partials
    exactly)."""
    outs = []
    for splits in (1, 2, 5):
        args = case(8, torch.float32, 2, 4, 2, 32, 4, "NHD", True, False)
        outs.append(run(args, False, "NHD", splits))
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-6)


def test_prefill_is_refused_with_a_typed_error():
    args = list(case(9, torch.float32, 2, 4, 2, 16, 4, "NHD", True, False))
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    with pytest.raises(lz.InvalidInputError, match="cu_seqlens_q"):
        trp.rope_paged_decode(
            q,
            k,
            v,
            qw,
            kw,
            cos,
            sin,
            cache,
            slots,
            pos,
            bt,
            lens,
            torch.tensor([0, 1, 2], dtype=torch.int32),
            None,
            False,
            KVLayout.NHD,
            1e-6,
        )


def test_every_split_takes_the_new_kv_from_registers():
    """The new token (position ``len - 1``) is attended with the k / v the program computed, not read back
    from the pool: on a GPU the splits run at the same time as split 0's write. The interpreter runs programs
    one after another, so this is seen by writing the token to a slot outside the sequence's block table: the
    attention still uses the new k / v at the last position, and the block-table slot of that position keeps
    its old contents."""
    args = case(10, torch.float32, 2, 4, 2, 16, 4, "NHD", True, False)
    q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens = args
    page = 4
    spare = sorted(set(range(cache.shape[0])) - set(bt.flatten().tolist()))[0]  # a block in no block table
    at_last = slots.clone()
    slots = torch.tensor([spare * page + i for i in range(2)])
    want, _ = oracle(q, k, v, qw, kw, cos, sin, cache, at_last, pos, bt, lens, 0.25, 1e-6, False, "NHD")
    before = cache.clone()
    got = run((q, k, v, qw, kw, cos, sin, cache, slots, pos, bt, lens), False, "NHD", 3)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    for s in at_last.tolist():
        assert torch.equal(cache[s // page, :, s % page], before[s // page, :, s % page])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({}, None),
        ({"seq_len_q": 7}, "SEQ_LEN_TOO_LONG"),
        ({"rotary_dim": 64}, "HEAD_DIM_MISMATCH"),
        ({"num_heads_q": 64, "num_heads_kv": 2}, "GQA_RATIO_INVALID"),
    ],
)
def test_routing_opt_in_decode_only(change, code):
    """On a CUDA context the kernel is eligible for decode but ranked below the composite form
    (``rope_paged.PRIORITY``: measured slower on the H200), chosen when preferred; prefill / append, partial
    rotary and GQA groups above 16 are refused with their reason codes."""
    from layerzero.core.context import SelectionContext
    from layerzero.core.policy import Policy
    from layerzero.core.selection import SelectionInputs, select
    from layerzero.testing.devices import fake_cuda_device
    from layerzero.testing.registries import routing_registry

    reg = routing_registry(
        "rope_paged_attention", [trp.kernel_spec(True, "")], base=("reference", "composite")
    )
    fields = dict(
        op="rope_paged_attention",
        device=fake_cuda_device((9, 0)),
        dtype=torch.bfloat16,
        batch=1,
        num_heads_q=16,
        num_heads_kv=8,
        head_dim=128,
        head_dim_v=128,
        seq_len_q=1,
        seq_len_kv=2048,
        rotary_dim=128,
        kv_layout="NHD",
        page_size=16,
        is_causal=True,
    )
    ctx = SelectionContext(**{**fields, **change})

    def pick(policy):
        return select(
            reg, ctx, SelectionInputs(policy, lambda _b: None, lambda _k: (0.0, None), log_fallbacks=False)
        )

    plan, report = pick(Policy.empty())
    assert plan.kernel_id == "composite.rope_paged_attention"
    cand = report.candidate(trp.KERNEL_ID)
    if code is None:
        assert cand.status.name == "ELIGIBLE"
        assert pick(Policy.prefer([trp.KERNEL_ID]))[0].kernel_id == trp.KERNEL_ID
    else:
        assert code in {r.code.name for r in cand.reasons}, cand.reasons
