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


def test_request_metrics_offline_in_order_and_split_by_hand(checkpoints):
    import time

    from layerzero.engine import RequestMetrics

    m = RequestMetrics(10.0, first_scheduled_time=10.005, time_in_queue=0.002)
    assert m.ttft_breakdown() is None  # no first token yet
    m.first_token_time, m.first_token_received_time = 10.015, 10.016
    assert m.ttft_breakdown() == {"to_core": 3.0, "queue": 2.0, "engine": 10.0, "to_front_end": 1.0}
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(checkpoints["qwen3"], max_num_seqs=1, **KW) as llm:
        before = time.monotonic()
        first, second = llm.generate([[5, 9, 14], [11, 4, 8]], sp, use_tqdm=False)
        after = time.monotonic()
    for out in (first, second):
        t = out.metrics
        assert before <= t.arrival_time <= t.first_scheduled_time <= t.first_token_time
        assert t.first_token_time <= t.first_token_received_time <= after
        assert t.time_in_queue == out.queue_time
    # the second waited for the first's 4 steps before its own first step
    assert second.metrics.first_scheduled_time >= first.metrics.first_token_time
