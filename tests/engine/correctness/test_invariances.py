"""Greedy outputs do not depend on how the engine schedules them: prefix cache on/off and hit/miss, both cache
kinds, chunked prefill with a tiny token budget, batch of one vs many, a pool so small that requests are
preempted, every scheduling policy, async scheduling (with each of those that stress it). Oracle:
transformers' greedy tokens and raw logprobs (1e-4)."""

from __future__ import annotations

import pytest
import torch

from ..conftest import hf_greedy, prompts

pytestmark = pytest.mark.integration
NEW = 10
FAMILY = "qwen3"


@pytest.fixture(scope="module")
def cases(checkpoints, hf_models):
    """Prompts sharing a 33-token prefix (2 full blocks of 16 + 1) plus unrelated ones, with HF's answers."""
    shared = prompts(1, seed=11, lo=33, hi=33)[0]
    ps = [shared + t[1:] for t in prompts(3, seed=12, lo=2, hi=20)] + prompts(3, seed=13, lo=5, hi=45)
    return ps, [hf_greedy(hf_models[FAMILY], p, NEW) for p in ps]


def _run(checkpoints, ps, one_by_one=False, **kw):
    from layerzero.engine import LLM

    opts = dict(device="cpu", dtype=torch.float32, max_model_len=96, num_kv_blocks=64, max_num_seqs=8)
    opts.update(kw)
    llm = LLM(checkpoints[FAMILY], **opts)
    sp = _greedy()
    if one_by_one:
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in ps]
    else:
        outs = llm.generate(ps, sp, use_tqdm=False)
    return llm, outs


def _greedy():
    from layerzero.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def _check(outs, refs):
    for o, (tokens, lps) in zip(outs, refs, strict=True):
        c = o.outputs[0]
        assert c.token_ids == tokens
        ours = [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, lps, strict=True)) < 1e-4


CONFIGS = {
    "radix": dict(prefix_cache="radix"),
    "hash": dict(prefix_cache="hash"),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-7": dict(max_num_batched_tokens=7),
    "tiny-pool": dict(num_kv_blocks=7, max_num_seqs=8, max_model_len=64),
    "lpm": dict(scheduling_policy="lpm"),
    "priority": dict(scheduling_policy="priority"),
    "block-size-5": dict(block_size=5, num_kv_blocks=200),
    "async": dict(async_scheduling=True),
    "async-hash": dict(async_scheduling=True, prefix_cache="hash"),
    "async-chunked-7": dict(async_scheduling=True, max_num_batched_tokens=7),
    "async-tiny-pool": dict(async_scheduling=True, num_kv_blocks=7, max_num_seqs=8, max_model_len=64),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_greedy_output_under_every_configuration(name, cases, checkpoints):
    ps, refs = cases
    llm, outs = _run(checkpoints, ps, **CONFIGS[name])
    _check(outs, refs)
    stats = llm.stats()
    if name.endswith("tiny-pool"):
        assert stats["preemptions"] > 0  # the configuration really preempts
    if name.endswith("chunked-7"):
        assert stats["last_step"]["num_prefill_tokens"] + stats["last_step"]["num_decode_tokens"] <= 7


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_prefix_cache_hits_when_run_one_by_one(kind, cases, checkpoints):
    ps, refs = cases
    llm, outs = _run(checkpoints, ps, one_by_one=True, prefix_cache=kind)
    _check(outs, refs)
    assert outs[1].num_cached_tokens == 32 and outs[2].num_cached_tokens == 32  # the shared 2 full blocks
    assert llm.stats()["prefix_hit_rate"] > 0
    # LLM.reset_prefix_cache (vLLM's): the same prompt again computes every block, with the same answer
    assert llm.reset_prefix_cache() is True
    again = llm.generate([ps[1]], _greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    _check([again], refs[1:2])


def test_batch_of_one_equals_batch(cases, checkpoints):
    ps, refs = cases
    _, outs = _run(checkpoints, ps, one_by_one=True, enable_prefix_caching=False)
    _check(outs, refs)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_batch_sharing_a_prefix_computes_it_once(kind, cases, checkpoints):
    """Submitted together, the prompts sharing a prefix are a prefix group: the first computes the 2 shared
    full blocks, the others wait a step and hit them (before prefix groups all three computed them in the same
    step)."""
    ps, refs = cases
    llm, outs = _run(checkpoints, ps, prefix_cache=kind)
    _check(outs, refs)
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 32, 32]


def test_lpm_above_its_scoring_limit_gives_the_same_outputs(monkeypatch, cases, checkpoints):
    """LPM with more waiting requests than it scores (LPM_MAX_WAITING patched to 2: the prefix-grouped sort)
    and two running slots: same outputs, and the group's later members hit its prefix."""
    from layerzero.engine.core.sched import policy as scheduling_policy

    monkeypatch.setattr(scheduling_policy, "LPM_MAX_WAITING", 2)
    ps, refs = cases
    order = [3, 0, 4, 1, 5, 2]  # the group's members interleaved with unrelated prompts
    _, outs = _run(checkpoints, [ps[i] for i in order], scheduling_policy="lpm", max_num_seqs=2)
    _check(outs, [refs[i] for i in order])
    assert sorted(o.num_cached_tokens for o in outs) == [0, 0, 0, 0, 32, 32]


def test_graphed_attention_path_gives_the_same_greedy_output(cases, checkpoints, monkeypatch):
    """The attention block as one ``lz.rope_paged_attention`` call (what the CUDA-graph runner's forwards
    take: ``ForwardBatch.graphed``) forced on every step here, prefill and decode on CPU: HF's tokens and
    logprobs, as the separate calls of eager steps give them; the op really ran (counted)."""
    import dataclasses

    import layerzero as lz
    from layerzero.engine.worker import model_runner

    build, calls = model_runner.build_forward_batch, []
    monkeypatch.setattr(
        model_runner, "build_forward_batch", lambda *a, **k: dataclasses.replace(build(*a, **k), graphed=True)
    )
    real = lz.rope_paged_attention

    def counted(*a, **k):
        calls.append(k.get("cu_seqlens_q") is None)
        return real(*a, **k)

    monkeypatch.setattr(lz, "rope_paged_attention", counted)
    ps, refs = cases
    _, outs = _run(checkpoints, ps)
    _check(outs, refs)
    assert any(calls) and not all(calls), "decode and prefill steps both took the fused call"
