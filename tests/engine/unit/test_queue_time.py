"""``RequestOutput.queue_time`` (the core's queue time, vLLM's ``time_in_queue``): set once a request ran,
never negative, longer for a request that waited behind another (one sequence at a time), and in a stream only
on the first delta."""

from __future__ import annotations

from layerzero.engine import LLM, SamplingParams

KW = {"device": "cpu", "max_model_len": 64, "num_kv_blocks": 32, "block_size": 4}


def test_queue_time_orders_waiting_requests(checkpoints):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(checkpoints["qwen3"], max_num_seqs=1, **KW) as llm:
        first, second = llm.generate([[5, 9, 14], [11, 4, 8]], sp, use_tqdm=False)
        assert first.queue_time is not None and second.queue_time is not None
        assert 0.0 <= first.queue_time < second.queue_time  # the second waited for the first's 8 steps
        deltas = list(llm.stream([7, 3, 2], sp))
    assert deltas[0].queue_time is not None and deltas[0].queue_time >= 0.0
    assert all(d.queue_time is None for d in deltas[1:])
