"""``SamplingParams.prompt_logprobs`` plumbing without an oracle: validation (typed errors, range), the
msgpack codec (int-keyed dicts, None entries), the scheduler's plain rows (JSON round trip; none for a request
that does not ask), the core sending them once with the request's first output, the front end (every output;
a stream's first delta only), the hidden-state rows the runner gathers, and that a step without prompt
logprobs takes the normal path (no extra rows, the graphs consulted as before) while one with them runs
eager."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import layerzero as lz
from layerzero.engine import EngineConfig, SamplingParams
from layerzero.engine.core import serial
from layerzero.engine.core.engine_core import EngineCore
from layerzero.engine.core.messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from layerzero.engine.core.sched.output import PromptLogprobsRows, SchedulerOutput
from layerzero.engine.core.sequence import PromptLogprobs
from layerzero.engine.frontend.output_processor import OutputProcessor
from layerzero.engine.outputs import RequestOutput, merge_deltas
from layerzero.engine.worker.prompt_logprobs import prompt_rows

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3", 2**40])
def test_out_of_range_or_wrong_type_is_a_typed_error(bad):
    with pytest.raises(lz.InvalidInputError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_valid_values_are_plain_ints():
    assert SamplingParams().prompt_logprobs is None
    assert SamplingParams(prompt_logprobs=np.int64(20)).prompt_logprobs == 20
    assert type(SamplingParams(prompt_logprobs=np.int32(0)).prompt_logprobs) is int
    with pytest.raises(lz.InvalidInputError, match="prompt_logprobs"):
        dataclasses.replace(SamplingParams(), prompt_logprobs=-3)


def test_msgpack_round_trip_keeps_int_keys_and_none_entries():
    req = EngineCoreRequest("r", [1, 2, 3], SamplingParams(prompt_logprobs=4, n=2))
    back = serial.decode(serial.encode(req))
    assert back.sampling_params == req.sampling_params and back.sampling_params.prompt_logprobs == 4
    plp = [None, {5: -0.25, 2: -1.5}, {7: -3.0}]
    outs = EngineCoreOutputs(
        [EngineCoreOutput("r", 0, [9], prompt_logprobs=plp), EngineCoreOutput("r", 1, [4])]
    )
    got = serial.decode(serial.encode(outs)).outputs
    assert got[0].prompt_logprobs == plp and got[1].prompt_logprobs is None
    assert all(type(k) is int for d in got[0].prompt_logprobs[1:] for k in d)


def test_holder_fills_once_and_counts_what_is_missing():
    h = PromptLogprobs(2, 4)
    assert not h.done and h.entries == [None] * 4
    h.fill(0, [{1: -1.0}, {2: -2.0}])
    h.fill(1, [{9: -9.0}, {3: -3.0}])  # entry 2 again (another sequence): the first value stays
    assert h.done and h.entries == [None, {1: -1.0}, {2: -2.0}, {3: -3.0}]
    assert PromptLogprobs(0, 1).done  # a one-token prompt has nothing to compute


def test_prompt_rows_are_the_sampled_rows_then_each_chunks_positions():
    rows = PromptLogprobsRows()
    rows.add(0, 2, [11, 12, 13])  # chunk 0 (tokens 0..3, does not sample): its first 3 positions
    rows.add(2, 0, [40])  # chunk 2 (tokens 5..7, samples): its first position
    got = prompt_rows([4, 1, 3], [False, True, True], rows)
    assert got.tolist() == [4, 7, 0, 1, 2, 5]


@pytest.fixture(scope="module")
def core(checkpoints):
    ec = EngineConfig(
        str(checkpoints["qwen3"]),
        torch.float32,
        "cpu",
        max_model_len=64,
        num_kv_blocks=40,
        max_num_seqs=4,
        max_num_batched_tokens=8,
    )
    return EngineCore(ec)


def test_scheduler_names_the_prompt_rows_as_plain_data(core):
    """A 12-token prompt in chunks of 8: positions 0..7 predict tokens 1..8 (the chunk's last position the
    next chunk's first token), then positions 8..10 tokens 9..11 (position 11 samples)."""
    ids = list(range(1, 13))
    core.add_request(EngineCoreRequest("p", ids, SamplingParams(prompt_logprobs=3, max_tokens=2)))
    core.add_request(EngineCoreRequest("q", [1, 6], SamplingParams(max_tokens=2)))
    try:
        out = core.scheduler.schedule()
        rows = out.prompt_logprobs
        assert out.req_ids == ["p"] and rows.chunks == [0] and rows.num_rows == [8] and rows.top_n == [3]
        assert rows.target_ids == [ids[1:9]]
        back = SchedulerOutput.from_dict(json.loads(json.dumps(out.to_dict())))
        assert back.prompt_logprobs == rows and back.sampling.params == out.sampling.params
        core.scheduler.after_forward()
        out = core.scheduler.schedule()
        assert out.req_ids == ["p", "q"] and out.prompt_logprobs.chunks == [0]
        assert out.prompt_logprobs.target_ids == [ids[9:12]]  # q asks for none: no row
    finally:
        core.abort_requests([EngineCoreAbort("p"), EngineCoreAbort("q")])
        core.step()


def test_core_sends_them_once_with_the_first_output(core):
    core.add_request(
        EngineCoreRequest(
            "a",
            list(range(1, 20)),
            SamplingParams(prompt_logprobs=1, n=2, max_tokens=3, temperature=0.0, ignore_eos=True),
        )
    )
    core.add_request(
        EngineCoreRequest("b", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    )
    seen = []
    while core.has_unfinished_requests():
        seen += core.step().outputs
    a = [o for o in seen if o.request_id == "a" and o.prompt_logprobs is not None]
    assert len(a) == 1 and len(a[0].prompt_logprobs) == 19 and a[0].prompt_logprobs[0] is None
    assert a[0] is next(o for o in seen if o.request_id == "a")  # the request's first output
    assert all(len(d) in (1, 2) for d in a[0].prompt_logprobs[1:])
    assert all(o.prompt_logprobs is None for o in seen if o.request_id == "b")


def test_a_normal_step_takes_the_normal_path(core, monkeypatch):
    """No request asks: no prompt rows, no prompt logits, the graphs consulted as before. One asks: its steps
    with prompt rows run eager (graphs_for is not consulted: prompt rows are prefill rows)."""
    runner = core.runner
    calls, graphs = [], []
    execute, graphs_for = runner.execute, runner.graphs_for

    def spy_execute(out, prev=None, greedy=False):
        res = execute(out, prev, greedy)
        calls.append((bool(out.prompt_logprobs), res.prompt_hidden is not None, len(graphs)))
        return res

    monkeypatch.setattr(runner, "execute", spy_execute)
    monkeypatch.setattr(runner, "graphs_for", lambda b: graphs.append(b) or graphs_for(b))
    core.add_request(EngineCoreRequest("n", [1, 2, 3, 4], SamplingParams(max_tokens=3)))
    while core.has_unfinished_requests():
        core.step()
    assert calls and all(not rows and not logits for rows, logits, _ in calls)
    assert [g for *_, g in calls] == list(range(1, len(calls) + 1))  # every step consulted the graphs
    calls.clear()
    graphs.clear()
    core.add_request(
        EngineCoreRequest("m", list(range(1, 12)), SamplingParams(max_tokens=3, prompt_logprobs=0))
    )
    while core.has_unfinished_requests():
        core.step()
    with_rows = [i for i, (rows, logits, _) in enumerate(calls) if rows]
    assert with_rows == [0, 1] and all(calls[i][1] for i in with_rows)
    # the prompt steps never consulted the graphs; each later (decode) step did
    assert calls[1][2] == 0 and calls[-1][2] == len(calls) - 2


def test_front_end_every_output_and_a_streams_first_delta():
    plp = [None, {3: -1.0}]
    for kind in ("cumulative", "delta", "final_only"):
        op = OutputProcessor(None)
        op.add_request(
            "r", None, [1, 3], SamplingParams(prompt_logprobs=0, n=2, max_tokens=2), output_kind=kind
        )
        first = op.process_outputs([EngineCoreOutput("r", 1, [5], prompt_logprobs=plp)]).request_outputs
        second = op.process_outputs(
            [
                EngineCoreOutput("r", 0, [6], finish_reason="length"),
                EngineCoreOutput("r", 1, [7], finish_reason="length"),
            ]
        ).request_outputs
        if kind == "final_only":
            assert first == [] and second[0].prompt_logprobs == plp
        elif kind == "delta":
            assert first[0].prompt_logprobs == plp and second[0].prompt_logprobs is None
            assert merge_deltas([*first, *second]).prompt_logprobs == plp
        else:
            assert first[0].prompt_logprobs == plp == second[0].prompt_logprobs


def test_merge_deltas_keeps_the_first_prompt_logprobs():
    a = RequestOutput("r", None, [1], [], prompt_logprobs=[None])
    b = RequestOutput("r", None, [1], [], finished=True)
    assert merge_deltas([a, b]).prompt_logprobs == [None] and merge_deltas([b]).prompt_logprobs is None
