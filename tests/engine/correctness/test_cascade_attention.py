"""Cascade attention in the engine (``LLM(cascade_attention=True)``): decode steps whose sequences share
cached prefix blocks attend the shared prefix once per group and their own blocks per sequence, merged by
log-sum-exp.

Oracles: transformers' greedy tokens and raw logprobs (1e-4, fp32) for prompts that share a prefix; the engine
without cascade attention for seeded sampling, several families, block sizes, async scheduling and a pool
small enough to preempt (same tokens; logprobs within 1e-4). Every run asserts that cascade steps really ran
(a run that never groups would pass trivially). The planner is checked on hand-built block tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ..conftest import assert_greedy_matches_hf, prompts

pytestmark = pytest.mark.integration
NEW = 10


def _shared_prompts(n_shared: int = 5, prefix_len: int = 37, seed: int = 41) -> list[list[int]]:
    """``n_shared`` prompts sharing a ``prefix_len``-token prefix, plus two unrelated ones."""
    shared = prompts(1, seed=seed, lo=prefix_len, hi=prefix_len)[0]
    return [shared + t[1:] for t in prompts(n_shared, seed=seed + 1, lo=2, hi=12)] + prompts(
        2, seed=seed + 2, lo=5, hi=30
    )


def _generate(ckpt, ps, sps, cascade, **kw):
    """Warm the prefix cache with the first prompt, then run every prompt in one batch: they are admitted
    together and hit the cached prefix, so their decode steps share its blocks."""
    from layerzero.engine import LLM, SamplingParams

    opts = dict(device="cpu", dtype=torch.float32, max_model_len=96, num_kv_blocks=96, max_num_seqs=8)
    opts.update(kw)
    llm = LLM(ckpt, cascade_attention=cascade, **opts)
    llm.generate([ps[0]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return llm, llm.generate(ps, sps, use_tqdm=False)


def test_greedy_equals_transformers_and_cascade_steps_ran(checkpoints, hf_models):
    from layerzero.engine import SamplingParams

    ps = _shared_prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    llm, outs = _generate(checkpoints["qwen3"], ps, sp, True)
    assert_greedy_matches_hf(hf_models["qwen3"], ps, outs, NEW)
    stats = llm.stats()
    assert stats["cascade_steps"] >= NEW - 2 and stats["cascade_saved_tokens"] > 0


def _params(i: int):
    from layerzero.engine import SamplingParams

    kinds = [
        dict(temperature=0.8, seed=10 + i, top_k=30, top_p=0.9, max_tokens=NEW, ignore_eos=True, logprobs=2),
        dict(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1),
        dict(temperature=0.6, seed=3 * i, min_p=0.05, max_tokens=NEW, ignore_eos=True, logprobs=0),
    ]
    return SamplingParams(**kinds[i % len(kinds)])


@pytest.mark.parametrize(
    "family, kw",
    [
        ("qwen3", {}),
        ("qwen3", dict(block_size=5, num_kv_blocks=300)),
        ("qwen3", dict(async_scheduling=True)),
        ("qwen3", dict(prefix_cache="hash")),
        ("qwen3", dict(num_kv_blocks=12, max_model_len=64)),
        ("llama", {}),
        ("qwen3_moe", {}),
    ],
    ids=["qwen3", "block-size-5", "async", "hash", "tiny-pool", "llama", "qwen3_moe"],
)
def test_same_tokens_as_without_cascade(checkpoints, family, kw):
    ps = _shared_prompts()
    sps = [_params(i) for i in range(len(ps))]
    on, on_outs = _generate(checkpoints[family], ps, sps, True, **kw)
    off, off_outs = _generate(checkpoints[family], ps, sps, False, **kw)
    for a, b in zip(on_outs, off_outs, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and ca.finish_reason == cb.finish_reason
        for da, db in zip(ca.logprobs, cb.logprobs, strict=True):
            assert da.keys() == db.keys() and max(abs(da[t] - db[t]) for t in da) < 1e-4
    assert on.stats()["cascade_steps"] > 0 and off.stats()["cascade_steps"] == 0
    on.engine.kv.check_invariants()


# ----------------------------------------------------------------------------------------------- the planner
def _plan(tables, lens, block_size=4, **policy):
    from layerzero.engine.worker.cascade import CascadePolicy, plan_cascade

    return plan_cascade(
        np.asarray(tables, dtype=np.int32),
        np.asarray(lens, dtype=np.int32),
        block_size,
        CascadePolicy(**policy),
    )


def _groups(arrays):
    rows, prefix_tables, prefix_lens, cu, suffix_tables, suffix_lens = arrays
    assert sorted(rows.tolist()) == list(range(len(rows)))  # a permutation: every row exactly once
    return {
        tuple(sorted(rows[cu[g] : cu[g + 1]].tolist())): (
            prefix_tables[g, : prefix_lens[g] // 4].tolist(),
            int(prefix_lens[g]),
        )
        for g in range(len(cu) - 1)
    }


def test_planner_groups_rows_by_shared_leading_blocks():
    # rows 0, 2, 3 share blocks [7, 8] (row 3 also 9, but row 0 does not); rows 1 and 4 share block 5 (row 1's
    # only full block before its last token); row 5 shares nothing: a group of one with an empty prefix
    tables = [[7, 8, 9, 20], [5, 6, 0, 0], [7, 8, 30, 31], [7, 8, 9, 40], [5, 50, 0, 0], [60, 61, 0, 0]]
    lens = [14, 6, 15, 16, 5, 7]
    arrays, saved = _plan(tables, lens, always=True)
    assert _groups(arrays) == {(0, 2, 3): ([7, 8], 8), (1, 4): ([5], 4), (5,): ([], 0)}
    rows, _, _, _, suffix_tables, suffix_lens = arrays
    at = {r: i for i, r in enumerate(rows.tolist())}  # suffix rows are in the cascade's order
    assert suffix_tables[at[0], :2].tolist() == [9, 20] and suffix_lens[at[0]] == 14 - 8
    assert suffix_tables[at[3], :2].tolist() == [9, 40] and suffix_lens[at[3]] == 16 - 8
    assert suffix_tables[at[1], 0] == 6 and suffix_lens[at[1]] == 2
    assert suffix_tables[at[4], 0] == 50 and suffix_lens[at[4]] == 1
    assert suffix_tables[at[5], :2].tolist() == [60, 61] and suffix_lens[at[5]] == 7
    assert saved == 2 * 8 + 1 * 4  # (members - 1) x prefix tokens per group


def test_planner_keeps_the_last_tokens_block_and_respects_thresholds():
    # both rows' last token sits in block 1 (len 5 with block size 4): only block 0 may be shared
    arrays, _ = _plan([[3, 4], [3, 4]], [5, 5], always=True)
    assert arrays[2].tolist() == [4] and arrays[5].tolist() == [1, 1]
    # lengths of exactly one block: the new token's block is block 0 itself: nothing to share
    assert _plan([[3], [3]], [4, 4], always=True) is None
    assert _plan([[3, 4]], [8], always=True) is None  # one row
    assert _plan([[1, 2], [3, 4]], [8, 8], always=True) is None  # no shared block
    big = [[1, 2, 3, 9], [1, 2, 3, 10]]
    assert _plan(big, [13, 13], min_saved_tokens=100) is None  # saves 12 tokens < 100
    assert _plan(big, [13, 13], min_saved_tokens=12, min_saved_fraction=0.5) is None  # 12 < 0.5 * 26
    assert _plan(big, [13, 13], min_saved_tokens=12, min_saved_fraction=0.4) is not None


def test_graph_buffers_pad_a_step_to_its_bucket():
    """The cascade graphs' static buffers (CUDA in the engine, checked here on CPU tensors): a 5-row step
    loaded into an 8-row bucket gives the step's rows exactly what the unpadded step computes, and the padded
    rows are groups of one that attend one token of block 0 (as padded plain-decode rows)."""
    import layerzero as lz
    from layerzero.engine.layers.attention import cascade_attention
    from layerzero.engine.worker.cascade import CascadeBatch
    from layerzero.engine.worker.cuda_graph import _CascadeBuffers

    tables = np.array(
        [[7, 8, 9, 20], [5, 6, 0, 0], [7, 8, 30, 31], [7, 8, 9, 40], [5, 50, 0, 0]], dtype=np.int32
    )
    lens = np.array([14, 6, 15, 16, 5], dtype=np.int32)
    arrays, saved = _plan(tables, lens, always=True)
    step = CascadeBatch(*(torch.from_numpy(a) for a in arrays), saved_tokens=saved)
    g = torch.Generator().manual_seed(0)
    cache = lz.allocate_kv_cache(64, 4, 2, 16, torch.float32)
    cache.copy_(torch.randn(cache.shape, generator=g))
    q = torch.randn(8, 4, 16, generator=g)
    want = cascade_attention(q[:5], cache, step, 0.25)
    buffers = _CascadeBuffers(16, 6, torch.device("cpu"))
    buffers.load(step, 5, 8, tables.shape[1], torch.arange(17))
    padded = buffers.batch(8)
    assert sorted(padded.rows.tolist()) == list(range(8)) and padded.cu_prefix[-1] == 8
    assert padded.cu_prefix.tolist() == [
        0,
        2,
        5,
        6,
        7,
        8,
        8,
        8,
        8,
    ]  # the 2 groups, the 3 padded rows alone, empty
    got = cascade_attention(q, cache, padded, 0.25)
    torch.testing.assert_close(got[:5], want, rtol=1e-6, atol=1e-6)
    plain = lz.paged_attention(
        q[5:], cache, torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, dtype=torch.int32), scale=0.25
    )
    torch.testing.assert_close(got[5:], plain, rtol=1e-6, atol=1e-6)


def test_option_is_validated_and_off_by_default_on_cpu(checkpoints):
    from layerzero import ConfigurationError
    from layerzero.engine import LLM

    opts = dict(device="cpu", dtype=torch.float32, max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ConfigurationError, match="cascade_attention"):
        LLM(checkpoints["qwen3"], cascade_attention="yes", **opts)
    with pytest.raises(ConfigurationError, match="cascade_attention"):
        LLM(checkpoints["qwen3"], cascade_attention=True, kv_cache_dtype="fp8", **opts)
    assert LLM(checkpoints["qwen3"], **opts).engine.runner.cascade is None


@pytest.mark.parametrize(
    ("device", "caching", "kv", "option", "want"),
    [
        ("cuda", True, "model", None, "thresholds"),  # the default on CUDA: steps that save enough reads
        ("cpu", True, "model", None, "off"),
        ("cuda", False, "model", None, "off"),  # nothing cached, nothing shared
        ("cuda", True, "fp8", None, "off"),  # a quantized pool: no cascade kernel reads it
        ("cuda", True, "model", False, "off"),
        ("cpu", True, "model", True, "always"),
        ("cuda", True, "model", True, "always"),
    ],
)
def test_default_policy_per_device_and_pool(device, caching, kv, option, want):
    """``cascade_attention=None`` resolves to ``CascadePolicy()`` (its save thresholds) only on CUDA with
    prefix caching and an unquantized pool; True to ``always``; False to off (the runner's resolution, without
    a device)."""
    from types import SimpleNamespace

    from layerzero.engine.worker.cascade import CascadePolicy
    from layerzero.engine.worker.model_runner import ModelRunner

    runner = SimpleNamespace(
        device=torch.device(device),
        dtype=torch.bfloat16,
        kv_dtype=torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16,
    )
    ec = SimpleNamespace(cascade_attention=option, enable_prefix_caching=caching, kv_cache_dtype="auto")
    expected = {"off": None, "thresholds": CascadePolicy(), "always": CascadePolicy(always=True)}[want]
    assert ModelRunner._cascade_policy(runner, ec) == expected
