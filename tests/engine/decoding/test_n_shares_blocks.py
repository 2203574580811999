"""``n > 1`` completions share their prompt's full KV blocks (one copy, reference-counted) instead of n
copies: counted on the engine core's KV manager while the completions run, against n requests with distinct
prompts of the same length (no sharing possible) and against the hand count."""

from __future__ import annotations

import math

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration
BLOCK, PROMPT, MAX_TOKENS, N = 4, 18, 5, 4


def _run(llm, reqs):
    """Step the core to the end with ``reqs`` queued; per step, the referenced blocks and the running
    tables."""
    core = llm.engine
    for r in reqs:
        core.add_request(r)
    peak, tables = 0, []
    while core.has_unfinished_requests():
        core.step()
        peak = max(peak, core.kv.pool.num_referenced)
        running = [s for s in core.scheduler.running if not s.finished]
        if len(running) == N:
            tables.append((core.kv.pool.num_referenced, [core.kv.block_table(s.seq_id) for s in running]))
    core.kv.check_invariants()
    return peak, tables


def test_n_completions_share_the_prompt_blocks(checkpoints):
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.core.messages import EngineCoreRequest

    llm = LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        max_model_len=32,
        num_kv_blocks=64,
        block_size=BLOCK,
        async_scheduling=False,
    )
    ps = prompts(N + 1, seed=61, lo=PROMPT, hi=PROMPT)
    sp = SamplingParams(n=N, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    peak, tables = _run(llm, [EngineCoreRequest("n", ps[0], sp)])
    shared = PROMPT // BLOCK  # the prompt's full blocks (16 of its 18 tokens)
    per_seq = math.ceil((PROMPT + MAX_TOKENS - 1) / BLOCK)  # blocks of one completion's computed tokens
    assert tables, "the n completions never ran together"
    for referenced, t in tables:
        assert all(x[:shared] == t[0][:shared] for x in t)  # the same block ids: one copy of the prompt
        private = sum(len(x) - shared for x in t)
        assert len({b for x in t for b in x[shared:]}) == private  # the rest: each completion's own
        assert referenced == shared + private  # and nothing else is held
    assert peak <= shared + N * (per_seq - shared)
    llm.engine.kv.reset_prefix_cache()
    one = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone, _ = _run(llm, [EngineCoreRequest(f"d{i}", p, one) for i, p in enumerate(ps[1:])])
    assert alone == N * per_seq > peak
