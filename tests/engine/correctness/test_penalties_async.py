"""Penalized requests under async scheduling (their counts on the device, ``worker/penalty_state.py``) give
the synchronous engine's tokens exactly, with chunked prefill, preemption by recompute (a pool too small for
the batch) and batches mixing penalized greedy, penalized seeded and plain rows; the sequences give their
state rows back. Oracle: the same engine with ``async_scheduling=False`` (whose penalties
``test_hf_parity.py`` checks against transformers and ``tests/engine/unit/test_penalty_state.py`` against the
float64 formulas)."""

from __future__ import annotations

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration


def _params(i: int):
    from layerzero.engine import SamplingParams

    kinds = [
        dict(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.5, presence_penalty=0.4),
        dict(temperature=0.0),
        dict(temperature=0.8, seed=11 + i, presence_penalty=1.2, top_k=20),
        dict(temperature=0.0, repetition_penalty=0.8, logprobs=2),
        dict(temperature=0.7, seed=5 * i, frequency_penalty=1.0),
    ]
    return SamplingParams(max_tokens=8 + i % 5, ignore_eos=True, **kinds[i % len(kinds)])


def _generate(checkpoints, async_scheduling: bool):
    from layerzero.engine import LLM

    llm = LLM(
        checkpoints["qwen3"],
        device="cpu",
        dtype=torch.float32,
        max_model_len=64,
        num_kv_blocks=7,
        max_num_seqs=5,
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )
    ps = prompts(10, seed=41, lo=3, hi=26)
    outs = llm.generate(ps, [_params(i) for i in range(len(ps))], use_tqdm=False)
    return llm, [(c.token_ids, c.finish_reason) for o in outs for c in o.outputs]


def test_async_equals_sync_with_preemption_and_chunked_prefill(checkpoints):
    sync, want = _generate(checkpoints, False)
    asyn, got = _generate(checkpoints, True)
    assert got == want
    assert asyn.stats()["preemptions"] > 0 and sync.stats()["preemptions"] > 0
    state = asyn.engine.executor.worker.sampler.penalties
    assert len(state.row_of) <= 5  # the last finished ones are released by the next step that runs
    asyn.generate([[1, 2, 3]], use_tqdm=False)
    assert not state.row_of
