"""Penalized requests on a GPU (``pytest -m gpu``): with their token counts on the device
(``worker/penalty_state.py``: pinned staging, non-blocking copies, counts updated after each draw) async
scheduling gives exactly the synchronous engine's tokens -- penalized greedy and seeded rows mixed with plain
rows, top-k / top-p rows (the sort-free kernel), a pool small enough to preempt -- and overlaps as much as an
unpenalized batch (penalized sequences are launched with their token still pending)."""

from __future__ import annotations

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.gpu


def _params(i: int):
    from layerzero.engine import SamplingParams

    kinds = [
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
        dict(temperature=0.0),
        dict(temperature=0.8, seed=11 + i, presence_penalty=1.2, top_k=20),
        dict(temperature=0.9, seed=3 * i, frequency_penalty=0.7, top_p=0.9),
        dict(temperature=0.7, seed=i, top_k=30, top_p=0.8, min_p=0.02),
    ]
    return SamplingParams(max_tokens=12 + i % 7, ignore_eos=True, **kinds[i % len(kinds)])


@pytest.mark.parametrize("blocks", [256, 12], ids=["ample", "preempting"])
def test_penalized_async_equals_sync(checkpoints, blocks):
    from layerzero.engine import LLM

    ps = prompts(16, seed=61, lo=3, hi=40)
    sps = [_params(i) for i in range(len(ps))]
    outs, gathered = {}, {}
    for mode in (False, True):
        llm = LLM(
            checkpoints["qwen3"],
            device="cuda",
            dtype=torch.float32,
            max_model_len=96,
            num_kv_blocks=blocks,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            async_scheduling=mode,
        )
        seen = []
        execute = llm.engine.runner.execute

        def spy(out, prev_tokens=None, greedy=False, llm=llm, seen=seen, execute=execute):
            seen.extend(
                s
                for s, _ in llm.engine.scheduler.scheduled
                if s.pending_index is not None and s.params.penalized
            )
            return execute(out, prev_tokens, greedy)

        llm.engine.runner.execute = spy
        res = llm.generate(ps, sps, use_tqdm=False)
        outs[mode] = [o.outputs[0].token_ids for o in res]
        gathered[mode] = len(seen)
        if blocks == 12:
            assert llm.stats()["preemptions"] > 0
    assert outs[True] == outs[False]
    assert gathered[False] == 0 and gathered[True] > 20
