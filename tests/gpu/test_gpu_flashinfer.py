"""FlashInfer kernels on a real GPU against float64 oracles (skipped when flashinfer does not import).

- ``flashinfer.attention`` (locked): prefill causal / non-causal, decode, GQA (ratios 1, 2, 8 -> CUDA-core and
  tensor-core decode), fp16/bf16, head dims 64/128/256, BHSD and BSHD inputs.
- ``flashinfer.paged_attention`` (locked): the seeded cases of tests/correctness/test_paged_attention.py's
  generator shape (decode + append, NHD/HND, page sizes 1/8/16/32, empty and length-1 sequences, NaN in every
  unused page and slot, garbage in unread block_tables entries), but with head_dim 128 only so FlashInfer
  JIT-compiles few kernels: >= 200 cases per dtype. Output buffers are NaN-poisoned by the cache itself.
- The plan cache: one miss then hits across "layers", an in-place seq_lens update re-plans, and results stay
  equal to the oracle after a re-plan.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.core.runtime import RUNTIME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "correctness"))
from _shapes import mismatch  # noqa: E402

pytestmark = pytest.mark.gpu

F64 = torch.float64
HALF = (torch.float16, torch.bfloat16)
PAGED_CASES = 104  # per dtype and layout: 2 layouts x 104 = 208 >= 200 per dtype


@pytest.fixture(autouse=True)
def _usable():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    RUNTIME.ensure_ready()
    backend = RUNTIME.registry.backend("flashinfer")
    if not backend.available:
        pytest.skip(f"flashinfer not usable here: {'; '.join(r.message for r in backend.reasons)}")
    yield
    lz.unlock("attention")
    lz.unlock("paged_attention")


def _stats():
    from layerzero.backends.flashinfer import plan_stats

    return plan_stats(RUNTIME.registry)


# ------------------------------------------------------------------------------------------ dense attention
def _oracle_bhsd(q, k, v, causal, scale):
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


DENSE = [  # (B, Hq, Hkv, Sq, Sk, D, causal)
    (1, 8, 8, 128, 128, 128, True),
    (3, 8, 2, 77, 77, 128, True),
    (2, 16, 2, 200, 333, 128, False),
    (4, 8, 8, 1, 517, 128, False),
    (5, 16, 2, 1, 1000, 128, False),
    (3, 32, 4, 1, 64, 128, False),
    (2, 8, 1, 1, 300, 128, False),
    (2, 4, 4, 65, 65, 64, True),
    (2, 8, 2, 1, 129, 64, False),
    (2, 4, 2, 96, 96, 256, True),
    (3, 4, 4, 1, 250, 256, False),
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_attention_matches_float64(dtype, layout):
    lz.lock("attention", "flashinfer.attention")
    gen = torch.Generator(device="cuda").manual_seed(0)
    failures = []
    for i, (b, hq, hkv, sq, sk, d, causal) in enumerate(DENSE):
        if dtype is torch.float16 and d != 128:
            continue  # fewer JIT kernels: other head dims in bf16 only
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, generator=gen)
        scale = 0.07 if i % 3 == 2 else None
        ref = _oracle_bhsd(q, k, v, causal, scale)
        if layout == "BSHD":
            q, k, v, ref = (t.transpose(1, 2).contiguous() for t in (q, k, v, ref))
        out = lz.attention(q, k, v, is_causal=causal, scale=scale, layout=layout)
        msg = mismatch(out, ref, dtype, f"case {i} {(b, hq, hkv, sq, sk, d, causal)}")
        if msg:
            failures.append(msg)
    assert not failures, "\n".join(failures)
    assert lz.which("attention", q, k, v, is_causal=False, layout=layout) == "flashinfer.attention"


def test_attention_refuses_top_left_causal_with_sq_ne_sk_and_masks():
    q = torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16)
    k = v = torch.randn(1, 4, 16, 64, device="cuda", dtype=torch.float16)
    lz.lock("attention", "flashinfer.attention")
    with pytest.raises(lz.NoKernelFoundError, match="CAUSAL_SEQ_MISMATCH"):
        lz.attention(q, k, v, is_causal=True)
    with pytest.raises(lz.NoKernelFoundError, match="MASK_UNSUPPORTED"):
        lz.attention(q, k, v, attn_mask=torch.ones(8, 16, dtype=torch.bool, device="cuda"))


# ------------------------------------------------------------------------------------------ paged
def _case(seed: int, decode: bool, layout: str):
    """Seeded paged inputs on CUDA: NaN cache except used slots, garbage in unread block_tables entries."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    page = (1, 8, 16, 32)[seed % 4]
    hkv = rng.choice((1, 2))
    ratio = (1, 2, 4, 8)[(seed // 4) % 4]
    d = 128
    lens = []
    for _ in range(rng.randint(1, 5)):
        kv = rng.choice((1, 2, rng.randint(1, 40), rng.randint(30, 90)))
        if decode:
            lens.append((1, kv))
        else:
            r = rng.random()
            lens.append((0, 0) if r < 0.15 else (kv, kv) if r < 0.5 else (rng.randint(0, kv), kv))
    need = [-(-kv // page) for _, kv in lens]
    nb = sum(need) + rng.randint(0, 3)
    ids = list(range(nb))
    rng.shuffle(ids)
    max_blocks = max(need + [1]) + rng.randint(0, 2)
    shape = (nb, 2, page, hkv, d) if layout == "NHD" else (nb, 2, hkv, page, d)
    cache = torch.full(shape, float("nan"), dtype=F64)
    table = torch.tensor(
        [[rng.choice((-1, nb, 0)) for _ in range(max_blocks)] for _ in lens], dtype=torch.int32
    )
    for s, n in enumerate(need):
        for j in range(n):
            table[s, j] = ids.pop()
    keys, vals = [], []
    for s, (_, kv) in enumerate(lens):
        kk = torch.randn(kv, hkv, d, generator=gen, dtype=F64)
        vv = torch.randn(kv, hkv, d, generator=gen, dtype=F64)
        for t in range(kv):
            blk, off = int(table[s, t // page]), t % page
            if layout == "NHD":
                cache[blk, 0, off], cache[blk, 1, off] = kk[t], vv[t]
            else:
                cache[blk, 0, :, off], cache[blk, 1, :, off] = kk[t], vv[t]
        keys.append(kk)
        vals.append(vv)
    q = torch.randn(sum(ql for ql, _ in lens), hkv * ratio, d, generator=gen, dtype=F64)
    cu = (
        None
        if decode
        else torch.tensor([0, *torch.tensor([ql for ql, _ in lens]).cumsum(0).tolist()], dtype=torch.int32)
    )
    scale = rng.choice((None, None, 0.05))
    causal = rng.random() < 0.8
    return (
        lens,
        q,
        cache,
        table,
        torch.tensor([kv for _, kv in lens], dtype=torch.int32),
        cu,
        keys,
        vals,
        scale,
        causal,
    )


def _paged_oracle(lens, q, keys, vals, scale, causal):
    out = torch.zeros_like(q)
    pos = 0
    d = q.shape[-1]
    sc = 1 / math.sqrt(d) if scale is None else scale
    for (ql, kv), k, v in zip(lens, keys, vals, strict=True):
        if ql:
            rep = q.shape[1] // k.shape[1]
            kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = torch.einsum("ihd,jhd->hij", q[pos : pos + ql], kk) * sc
            if causal:
                vis = torch.arange(kv)[None, :] <= kv - ql + torch.arange(ql)[:, None]
                s = s.masked_fill(~vis, float("-inf"))
            out[pos : pos + ql] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)
        pos += ql
    return out


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_matches_float64(dtype, layout):
    lz.lock("paged_attention", "flashinfer.paged_attention")
    failures = []
    for seed in range(PAGED_CASES):
        decode = seed % 2 == 0
        lens, q, cache, table, seq_lens, cu, keys, vals, scale, causal = _case(seed, decode, layout)
        ref = _paged_oracle(
            lens,
            q.to(dtype).to(F64),
            [k.to(dtype).to(F64) for k in keys],
            [v.to(dtype).to(F64) for v in vals],
            scale,
            causal,
        )
        out = lz.paged_attention(
            q.to(dtype).cuda(),
            cache.to(dtype).cuda(),
            table.cuda(),
            seq_lens.cuda(),
            cu_seqlens_q=None if cu is None else cu.cuda(),
            scale=scale,
            is_causal=causal,
            kv_layout=layout,
        )
        msg = mismatch(out.cpu(), ref, dtype, f"seed {seed} decode={decode} lens={lens} {layout}")
        if msg:
            failures.append(msg)
    assert not failures, f"{len(failures)} of {PAGED_CASES} failed:\n" + "\n".join(failures[:8])


def test_plan_cache_hits_across_layers_and_replans_on_update():
    lz.lock("paged_attention", "flashinfer.paged_attention")
    dtype = torch.bfloat16
    lens, q, cache, table, seq_lens, _, keys, vals, scale, _ = _case(4, True, "NHD")
    q, cache, table, seq_lens = q.to(dtype).cuda(), cache.to(dtype).cuda(), table.cuda(), seq_lens.cuda()
    before = _stats()
    outs = [lz.paged_attention(q, cache, table, seq_lens, scale=scale) for _ in range(6)]  # 6 "layers"
    after = _stats()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 5
    assert all(torch.equal(o, outs[0]) for o in outs)
    # shorten every sequence by one token in place: re-plan, and the result follows the new lengths
    keep = seq_lens.clone()
    seq_lens.sub_((seq_lens > 1).int())
    short = [(1, int(n)) for n in seq_lens.tolist()]
    ref = _paged_oracle(
        short,
        q.cpu().to(F64),
        [k[:n].to(dtype).to(F64) for k, (_, n) in zip(keys, short, strict=True)],
        [v[:n].to(dtype).to(F64) for v, (_, n) in zip(vals, short, strict=True)],
        scale,
        False,
    )
    out = lz.paged_attention(q, cache, table, seq_lens, scale=scale)
    assert _stats().misses - after.misses == 1
    assert mismatch(out.cpu(), ref, dtype, "after in-place update") is None
    seq_lens.copy_(keep)
    torch.testing.assert_close(lz.paged_attention(q, cache, table, seq_lens, scale=scale), outs[0])


def test_warmup_compiles_and_selects_flashinfer_for_paged():
    lens, q, cache, table, seq_lens, cu, *_ = _case(9, False, "HND")
    dtype = torch.float16
    args = (q.to(dtype).cuda(), cache.to(dtype).cuda(), table.cuda(), seq_lens.cuda())
    chosen = lz.warmup("paged_attention", [(args, {"cu_seqlens_q": cu.cuda(), "kv_layout": "HND"})])
    assert chosen == ["flashinfer.paged_attention"]
