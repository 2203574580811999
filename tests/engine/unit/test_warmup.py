"""The start-up warm-up (``LLM(warmup=...)``, ``layerzero.engine.worker.warmup``): its shape plan covers the
scheduler's step shapes and the sampler's paths; it leaves the engine as it was (KV pools byte for byte, no KV
held, an empty prefix cache, the random streams), so seeded and unseeded outputs are the same with and without
it; it works eager and (on CPU) without graphs, with cascade attention and an int8 KV pool; the option's
default (off on CPU) and its stats."""

from __future__ import annotations

import pytest
import torch

from layerzero import ConfigurationError

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------------------------- the plan (no model)
def test_ladders():
    from layerzero.engine.worker.warmup import decode_ladder, row_ladder, token_ladder

    small = list(range(2, 17))  # lz.linear's exact row counts
    assert token_ladder(64) == [*small, 32, 64]
    assert token_ladder(100) == [*small, 32, 64, 100]
    assert token_ladder(8) == list(range(2, 9))
    assert token_ladder(8192)[-1] == 8192 and len(token_ladder(8192)) == 15 + 9
    assert row_ladder(8) == list(range(1, 9))
    r = row_ladder(256)
    assert set(range(1, 17)) | {31, 32, 63, 64, 127, 128, 255, 256} == set(r)
    assert decode_ladder(8) == list(range(1, 8)) and decode_ladder(1) == []
    assert decode_ladder(256) == row_ladder(255) and max(decode_ladder(256)) == 255


def _check_bounds(steps, budget, seqs, max_len):
    for s in steps:
        assert 1 <= s.num_tokens <= budget and 1 <= s.num_seqs <= seqs, s
        assert all(st >= 0 and n >= 1 and st + n <= max_len for st, n in s.chunks), s


def test_plan_covers_the_step_shapes():
    from layerzero.engine.worker.warmup import plan_steps

    steps = plan_steps(64, 8, 128, 16, eager_decode=True, cascade=False)
    _check_bounds(steps, 64, 8, 128)
    kinds = {s.kind for s in steps}
    assert kinds == {"prefill", "mixed", "decode"}
    prefill = [s for s in steps if s.kind == "prefill"]
    # every power-of-two bucket of the budget, and one count inside each (not a multiple of 16)
    assert {s.num_tokens for s in prefill} == set(range(2, 17)) | {31, 32, 63, 64}
    assert any(s.num_seqs > 1 and s.chunks[0][0] > 0 for s in prefill)  # a chunked prefill's continuation
    mixed = [s for s in steps if s.kind == "mixed"]
    decode_rows = {sum(1 for _, n in s.chunks if n == 1) for s in mixed}
    assert set(range(1, 8)) <= decode_rows
    assert {s.num_tokens for s in mixed if s.num_seqs == 8} == {64, 7 + 17}  # full budget, and a short chunk
    decode = [s for s in steps if s.kind == "decode"]
    assert all(n == 1 for s in decode for _, n in s.chunks)
    assert {s.num_seqs for s in decode} == set(range(1, 9))
    assert {s.chunks[0][0] + 1 for s in decode if s.num_seqs == 1} >= {16, 32, 64, 128}  # batch 1, KV ladder


def test_plan_without_eager_decode_and_with_cascade():
    from layerzero.engine.worker.warmup import plan_steps

    graphs = plan_steps(64, 8, 128, 16, eager_decode=False, cascade=False)
    assert not any(s.kind == "decode" for s in graphs)  # the captured graphs run (and warmed) decode
    casc = [s for s in plan_steps(64, 8, 256, 16, eager_decode=False, cascade=True) if s.kind == "cascade"]
    assert casc and all(s.shared_blocks >= 2 and s.num_seqs >= 3 for s in casc)
    assert any(n > 1 for s in casc for _, n in s.chunks)  # a mixed cascade step (prefill chunk)
    _check_bounds(casc, 64, 8, 256)


def test_plan_splits_a_budget_longer_than_a_sequence():
    from layerzero.engine.worker.warmup import plan_steps

    steps = plan_steps(512, 4, 128, 16, eager_decode=False, cascade=False)
    _check_bounds(steps, 512, 4, 128)
    assert 512 in {s.num_tokens for s in steps if s.kind == "prefill"}


def test_sampler_plan_covers_every_path():
    from layerzero.engine.worker.warmup import SAMPLER_PATHS, plan_sampler, row_ladder

    plan = plan_sampler(8)
    assert {p for p, _ in plan} == set(SAMPLER_PATHS)
    assert {n for p, n in plan if p == "greedy"} == set(row_ladder(8))
    assert {
        "greedy",
        "greedy_logprobs",
        "temperature",
        "seeded",
        "top_k",
        "top_p",
        "min_p",
        "penalties",
    } <= set(SAMPLER_PATHS)


# ------------------------------------------------------------------------------------------ the engine
def _llm(ck, **kw):
    from layerzero.engine import LLM

    opts = dict(
        device="cpu", dtype=torch.float32, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32
    )
    return LLM(ck, **{**opts, **kw})


def test_default_off_on_cpu_and_the_option_is_checked(checkpoints):
    from layerzero.engine.config import EngineConfig

    llm = _llm(checkpoints["qwen3"])
    st = llm.stats()
    assert llm.engine.executor.warmup is None and st["warmup_s"] == 0.0 and st["warmup_shapes"] == 0
    assert st["startup_s"] > 0
    with pytest.raises(ConfigurationError, match="warmup"):
        EngineConfig("m", warmup="yes")


def test_stats_report_the_warmup(checkpoints):
    llm = _llm(checkpoints["qwen3"], warmup=True)
    rep = llm.engine.executor.warmup
    st = llm.stats()
    assert rep.failed == [] and rep.steps > 10 and rep.sampler > 10 and rep.graphs == 0  # CPU: no graphs
    assert rep.attention > 10
    assert st["warmup_shapes"] == rep.shapes == rep.steps + rep.attention + rep.sampler
    assert 0 < st["warmup_s"] <= st["startup_s"]


def test_warmup_leaves_the_engine_as_it_was(checkpoints):
    from layerzero.engine.worker.warmup import warm_up

    llm = _llm(checkpoints["qwen3"], warmup=False, enable_prefix_caching=True)
    core, runner = llm.engine, llm.engine.runner
    sampler = core.executor.worker.sampler
    pools = [c.clone() for c in runner.kv_caches]
    gen, cpu_rng = sampler.generator.get_state(), torch.get_rng_state()
    rep = warm_up(runner, sampler, 4, 32)
    assert rep.failed == [] and rep.steps > 0
    assert all(torch.equal(a, b) for a, b in zip(pools, runner.kv_caches, strict=True))  # no KV written
    assert torch.equal(sampler.generator.get_state(), gen) and torch.equal(torch.get_rng_state(), cpu_rng)
    assert core.kv.usage() == 0.0 and core.kv.stats().num_cached_blocks == 0
    assert not core.scheduler.has_unfinished() and core.stats.steps == 0
    assert runner.cascade_steps == 0 and core.executor.worker.prev_tokens is None


def _outputs(llm):
    from layerzero.engine import SamplingParams

    prompts = [[1, 5, 9, 13] * 5, [1, 7, 7, 2, 3], [1] + list(range(3, 40)), [1, 4] * 9]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True),  # the engine's stream
        SamplingParams(temperature=0.7, repetition_penalty=1.2, max_tokens=8, ignore_eos=True, logprobs=1),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(
    "family,kw",
    [
        ("qwen3", {}),
        ("qwen3", {"enforce_eager": True}),
        ("llama", {"cascade_attention": True}),
        # a mixed cascade step whose chunk outnumbers its group's prefix keys (H200, 2026-11-29: the
        # shared-prefix call's capacity check refused it)
        ("llama", {"cascade_attention": True, "max_num_batched_tokens": 96}),
        ("qwen3", {"kv_cache_dtype": "int8"}),  # calibrated by the first real prefill, not a dummy one
        ("qwen3_moe", {"max_num_batched_tokens": 16, "max_num_seqs": 2}),
    ],
    ids=["qwen3", "eager", "llama-cascade", "llama-cascade-wide", "int8-kv", "moe"],
)
def test_outputs_equal_with_and_without_warmup(checkpoints, family, kw):
    from layerzero.engine.worker.warmup import plan_steps

    ck = checkpoints[family]
    cold = _llm(ck, warmup=False, seed=3, **kw)
    want = _outputs(cold)
    del cold
    warm = _llm(ck, warmup=True, seed=3, **kw)
    rep = warm.engine.executor.warmup
    assert rep.failed == [] and rep.steps > 0
    if kw.get("cascade_attention"):  # CPU: no graphs, so decode (and cascade decode) steps run eager
        assert warm.engine.runner.cascade is not None
        budget, seqs = kw.get("max_num_batched_tokens", 32), kw.get("max_num_seqs", 4)
        assert rep.steps == len(plan_steps(budget, seqs, 128, 16, eager_decode=True, cascade=True))
    assert _outputs(warm) == want
    assert warm.engine.kv.usage() == 0.0


def test_attention_plan_covers_the_paged_key_buckets():
    from layerzero.engine.worker.warmup import plan_attention

    def bucket(n):
        return n if n <= 1 else 1 << (n - 1).bit_length()

    budget, seqs, max_len, bs = 256, 8, 128, 16
    cases = plan_attention(budget, seqs, max_len, bs, decode=True)
    keys = set()
    for chunks in cases:
        t = sum(n for _, n in chunks)
        assert len(chunks) <= seqs and t <= budget and all(s + n <= max_len for s, n in chunks)
        width = max(-(-(s + n) // bs) for s, n in chunks)
        keys.add((bucket(len(chunks)), bucket(t) if t > len(chunks) else "decode", bucket(width)))
    for b in (1, 2, 4, 8):  # every feasible (sequences, tokens, width) bucket, prefill and decode
        for w in (1, 2, 4, 8):
            assert (b, "decode", w) in keys
            for t in (2, 4, 8, 16, 32, 64, 128, 256):
                if b < t <= b * w * bs:
                    assert (b, t, w) in keys, (b, t, w)
    assert not any(all(n == 1 for _, n in c) for c in plan_attention(budget, seqs, max_len, bs, False))


def test_no_selection_is_left_for_the_first_run(checkpoints):
    """After the warm-up, a workload of ragged prompts (prefill, chunked prefill, mixed and decode steps,
    sampled with temperature) makes no new LayerZero selection: every shape bucket was met at start-up."""
    from layerzero.core.runtime import RUNTIME
    from layerzero.engine import SamplingParams

    from ..conftest import prompts

    llm = _llm(checkpoints["qwen3"], warmup=True, max_num_seqs=8, max_num_batched_tokens=64)
    params = [SamplingParams(temperature=0.6, max_tokens=6 + i, ignore_eos=True) for i in range(12)]
    cache = RUNTIME.cache
    before = cache.stats().misses
    llm.generate(prompts(12, seed=5, lo=3, hi=100), params, use_tqdm=False)
    assert RUNTIME.cache is cache and cache.stats().misses == before


def test_structured_requests_make_no_new_selection(checkpoints):
    """The warm-up applies a grammar bitmask at every row count, to all of a step's rows and to a subset: a
    batch mixing structured and free requests selects nothing new for ``lz.apply_token_bitmask``."""
    from layerzero.core.runtime import RUNTIME
    from layerzero.engine import SamplingParams
    from layerzero.engine.structured_params import StructuredOutputsParams

    from ..conftest import prompts

    llm = _llm(checkpoints["qwen3"], warmup=True, max_num_seqs=8, max_num_batched_tokens=64)
    choice = SamplingParams(
        temperature=0.6, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["ab", "c"])
    )
    free = SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True)
    cache = RUNTIME.cache
    before = cache.stats().misses
    outs = llm.generate(
        prompts(6, seed=9, lo=3, hi=20), [choice, free, choice, choice, free, choice], use_tqdm=False
    )
    assert all(outs[i].outputs[0].text in ("ab", "c") for i in (0, 2, 3, 5))  # the constraint held
    assert RUNTIME.cache is cache and cache.stats().misses == before
