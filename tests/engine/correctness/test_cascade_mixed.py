"""Cascade attention in steps with prefill chunks (eager steps that admit new requests while others decode):
the planner on hand-built block tables, the attention against a float64 oracle written out here (causal
attention of each sequence's new tokens over its gathered KV, bottom-right aligned), and the engine against
itself without cascade and against transformers, with a spy proving that mixed cascade steps ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ..conftest import assert_greedy_matches_hf, prompts

pytestmark = pytest.mark.integration


def _plan(tables, lens, q_lens, block_size=4):
    from layerzero.engine.worker.cascade import CascadePolicy, plan_cascade

    return plan_cascade(
        np.asarray(tables, dtype=np.int32),
        np.asarray(lens, dtype=np.int32),
        block_size,
        CascadePolicy(always=True),
        np.asarray(q_lens, dtype=np.int64),
    )


def test_planner_orders_tokens_by_group_and_keeps_new_tokens_out_of_the_prefix():
    # seq 0: decode (14 tokens, 1 new) on blocks [7, 8, 9, 20]; seq 1: a 6-token prefill chunk of a new
    # request that hit blocks [7, 8] (its KV 8 + 6 = 14, first new token at position 8: blocks 0-1 are
    # shareable); seq 2: decode on [5, 6]; seq 3: a 3-token chunk at position 9 on [7, 8, 30, 31] (first new
    # token in block 2)
    tables = [[7, 8, 9, 20], [7, 8, 40, 41], [5, 6, 0, 0], [7, 8, 30, 31]]
    lens, q_lens = [14, 14, 6, 12], [1, 6, 1, 3]
    arrays, saved = _plan(tables, lens, q_lens)
    rows, prefix_tables, prefix_lens, cu_prefix, suffix_tables, suffix_lens, cu_q = arrays
    starts = np.concatenate(
        [[0], np.cumsum(q_lens)]
    )  # the step's token rows per sequence: 0 | 1-6 | 7 | 8-10
    # sorted by first block: seq 2 (block 5) alone, then seqs 0, 1, 3 (block 7) sharing [7, 8]
    assert rows.tolist() == [7, 0, 1, 2, 3, 4, 5, 6, 8, 9, 10]
    assert sorted(rows.tolist()) == list(range(int(starts[-1])))
    assert prefix_lens.tolist() == [0, 8] and prefix_tables[1].tolist() == [7, 8]
    assert cu_prefix.tolist() == [0, 1, 11]  # token counts per group: 1 | 1 + 6 + 3
    assert cu_q.tolist() == [0, 1, 2, 8, 11]  # the sequences' tokens in the cascade's order: 2 | 0 | 1 | 3
    assert suffix_lens.tolist() == [6, 14 - 8, 14 - 8, 12 - 8]
    assert suffix_tables[2, :2].tolist() == [40, 41] and suffix_tables[3, :2].tolist() == [30, 31]
    assert saved == 2 * 8


def test_planner_caps_the_prefix_at_the_first_new_token():
    # a chunk starting at position 4 (block 1) may share block 0 only, although both tables agree on two
    # blocks
    arrays, _ = _plan([[3, 4, 5], [3, 4, 6]], [10, 12], [6, 1])
    assert arrays[2].tolist() == [4] and arrays[5].tolist() == [6, 8]
    # a chunk from position 0 shares nothing: no cascade
    assert _plan([[3, 4], [3, 4]], [8, 8], [8, 1]) is None


def _oracle(q, cache, tables, lens, q_lens, scale):
    """float64 causal attention of each sequence's new tokens over its own KV gathered through its block
    table."""
    out, p = [], cache.shape[2]
    t0 = 0
    for table, n, m in zip(tables, lens, q_lens, strict=True):
        blocks = cache[torch.as_tensor(table[: -(-n // p)], dtype=torch.long)].double()  # [nb, 2, P, Hkv, D]
        k = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:n]
        v = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:n]
        qs = q[t0 : t0 + m].double()
        rep = qs.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("thd,nhd->htn", qs, k) * scale
        pos = torch.arange(n - m, n)[:, None]
        s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        out.append(torch.einsum("htn,nhd->thd", s.softmax(-1), v))
        t0 += m
    return torch.cat(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_cascade_attention_equals_a_float64_oracle(seed):
    """Seeded ragged steps: groups sharing 1-3 prefix blocks, decode rows, chunks that hit a prefix, in each
    group a member whose new tokens start inside the last common block (the plan must shorten the group's
    prefix), a chunk from scratch, block size 5 (odd), GQA 3:1."""
    import layerzero as lz
    from layerzero.engine.layers.attention import cascade_attention
    from layerzero.engine.worker.cascade import CascadeBatch

    rng = np.random.default_rng(seed)
    p, hkv, hq, d, nblocks = 5, 2, 6, 16, 120
    free = list(rng.permutation(np.arange(1, nblocks)))
    tables, lens, q_lens = [], [], []
    for group in range(3):
        shared = [int(free.pop()) for _ in range(group + 1)]
        for member in range(int(rng.integers(2, 4))):
            start = len(shared) * p + int(rng.integers(0, 7))  # first new token after the shared blocks
            if member == 1:  # ... or inside the last of them (it still lists the same block ids)
                start = (len(shared) - 1) * p + int(rng.integers(0, p))
            m = 1 if rng.random() < 0.5 else int(rng.integers(2, 9))
            if (
                member == 1
            ):  # a chunk reaching past that block: a cap at the last token would share it wrongly
                m = int(rng.integers(p + 1, 9))
            n = start + m
            tables.append(shared + [int(free.pop()) for _ in range(-(-n // p) - len(shared))])
            lens.append(n)
            q_lens.append(m)
    tables.append([int(free.pop()) for _ in range(3)])  # a new request's first chunk: nothing to share
    lens.append(11)
    q_lens.append(11)
    width = max(len(t) for t in tables)
    padded = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    arrays, saved = _plan(padded, lens, q_lens, block_size=p)
    step = CascadeBatch(
        *(torch.from_numpy(a) for a in arrays[:6]),
        saved_tokens=saved,
        cu_seqlens_q=torch.from_numpy(arrays[6]),
    )
    g = torch.Generator().manual_seed(seed)
    cache = lz.allocate_kv_cache(nblocks, p, hkv, d, torch.float32)
    cache.copy_(torch.randn(cache.shape, generator=g))
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    got = cascade_attention(q, cache, step, 0.3)
    want = _oracle(q, cache, tables, lens, q_lens, 0.3)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def mixed_spy(monkeypatch):
    """Counts cascade_attention calls whose step carries prefill chunks (cu_seqlens_q set)."""
    from layerzero.engine.layers import attention

    seen = {"mixed": 0, "decode": 0}
    real = attention.cascade_attention

    def spy(q, kv_cache, c, scale):
        seen["mixed" if c.cu_seqlens_q is not None else "decode"] += 1
        return real(q, kv_cache, c, scale)

    monkeypatch.setattr(attention, "cascade_attention", spy)
    return seen


def _run(ckpt, cascade, sps, ps, **kw):
    """Two running slots for 7 requests sharing a 26-token prefix: as one finishes (max_tokens differ) the
    next is admitted, a chunk hitting the cached prefix, in a step where the other decodes."""
    from layerzero.engine import LLM, SamplingParams

    opts = dict(
        device="cpu", dtype=torch.float32, max_model_len=96, num_kv_blocks=96, max_num_seqs=2, block_size=4
    )
    opts.update(kw)
    llm = LLM(ckpt, cascade_attention=cascade, **opts)
    llm.generate([ps[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return llm, llm.generate(ps, sps, use_tqdm=False)


def _shared(n=7, seed=61):
    shared = prompts(1, seed=seed, lo=26, hi=26)[0]
    return [shared + t[1:] for t in prompts(n, seed=seed + 1, lo=2, hi=9)]


@pytest.mark.parametrize(
    "family, kw",
    [("qwen3", {}), ("qwen3", dict(max_num_batched_tokens=5)), ("llama", dict(async_scheduling=True))],
    ids=["qwen3", "chunked-5", "llama-async"],
)
def test_engine_with_mixed_cascade_steps_equals_plain(checkpoints, mixed_spy, family, kw):
    from layerzero.engine import SamplingParams

    ps = _shared()
    sps = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=2
        )
        for i in range(len(ps))
    ]
    _, off = _run(checkpoints[family], False, sps, ps, **kw)
    assert mixed_spy["mixed"] == 0
    on_llm, on = _run(checkpoints[family], True, sps, ps, **kw)
    assert mixed_spy["mixed"] > 0 and mixed_spy["decode"] > 0, mixed_spy
    for a, b in zip(on, off, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        for da, db in zip(ca.logprobs, cb.logprobs, strict=True):
            assert da.keys() == db.keys() and max(abs(da[t] - db[t]) for t in da) < 1e-4
    on_llm.engine.kv.check_invariants()


def test_engine_with_mixed_cascade_steps_equals_transformers(checkpoints, hf_models, mixed_spy):
    from layerzero.engine import SamplingParams

    ps = _shared(n=5, seed=71)
    new = 6
    _, outs = _run(
        checkpoints["qwen3"],
        True,
        SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0),
        ps,
    )
    assert mixed_spy["mixed"] > 0
    assert_greedy_matches_hf(hf_models["qwen3"], ps, outs, new)
