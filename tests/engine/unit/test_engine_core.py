"""The engine core used directly (no front end): requests in as ``EngineCoreRequest``, token ids out as
``EngineCoreOutput`` s, aborts free the KV blocks; and the step it schedules is plain data
(``SchedulerOutput``: JSON / msgpack-able, no live sequence in it)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from layerzero.engine import EngineConfig, SamplingParams
from layerzero.engine.core.engine_core import EngineCore
from layerzero.engine.core.messages import EngineCoreAbort, EngineCoreRequest
from layerzero.engine.core.sched.output import SchedulerOutput
from layerzero.engine.core.sequence import Sequence

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def core(checkpoints):
    ec = EngineConfig(
        str(checkpoints["qwen3"]), torch.float32, "cpu", max_model_len=48, num_kv_blocks=40, max_num_seqs=4
    )
    return EngineCore(ec)


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _drain(core):
    outs = []
    while core.has_unfinished_requests():
        outs += core.step().outputs
    return outs


def test_requests_in_token_ids_out(core):
    core.add_request(EngineCoreRequest("a", [1, 5, 9], _greedy(4)))
    core.add_request(EngineCoreRequest("b", [1, 7], SamplingParams(temperature=0.0, max_tokens=3, n=2)))
    outs = _drain(core)
    got: dict[tuple[str, int], list[int]] = {}
    for o in outs:
        got.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    assert {k: len(v) for k, v in got.items()} == {("a", 0): 4, ("b", 0): 3, ("b", 1): 3}
    assert got[("b", 0)] == got[("b", 1)]  # greedy: both completions the same
    finals = [o for o in outs if o.finished]
    assert sorted((o.request_id, o.index, o.finish_reason) for o in finals) == [
        ("a", 0, "length"),
        ("b", 0, "length"),
        ("b", 1, "length"),
    ]
    assert core.requests == {} and core.kv.usage() == 0.0
    st = core.get_stats()
    assert st.num_running_reqs == st.num_waiting_reqs == 0 and st.generation_tokens >= 10


def test_abort_frees_the_blocks_and_ends_with_abort(core):
    core.add_request(EngineCoreRequest("x", [1, 5, 9, 4], _greedy(30)))
    core.step()
    core.step()
    assert core.kv.usage() > 0.0
    core.abort_requests([EngineCoreAbort("x")])
    assert core.kv.usage() == 0.0 and core.requests == {} and not core.has_unfinished_requests()
    outs = core.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outs] == [("x", "abort")]
    core.kv.check_invariants()


def test_a_stop_abort_ends_one_completion_with_the_stop_string(core):
    core.add_request(EngineCoreRequest("s", [1, 5], SamplingParams(temperature=0.0, max_tokens=6, n=2)))
    core.step()
    core.abort_requests([EngineCoreAbort("s", 1, "stop", "xyz")])
    outs = _drain(core)
    ends = {o.index: (o.finish_reason, o.stop_reason) for o in outs if o.finished}
    assert ends == {1: ("stop", "xyz"), 0: ("length", None)}
    with pytest.raises(Exception, match="request_id"):
        core.add_request(EngineCoreRequest("", [1], _greedy(1)))


def test_a_duplicate_request_id_is_refused(core):
    core.add_request(EngineCoreRequest("d", [1, 2], _greedy(2)))
    with pytest.raises(Exception, match="a new id"):
        core.add_request(EngineCoreRequest("d", [1, 2], _greedy(2)))
    _drain(core)


def test_the_scheduler_output_is_plain_data(core):
    core.add_request(
        EngineCoreRequest("p", [1, 5, 9, 4, 3], SamplingParams(temperature=0.7, seed=3, max_tokens=2))
    )
    core.add_request(EngineCoreRequest("q", [1, 6], SamplingParams(repetition_penalty=1.2, max_tokens=2)))
    out = core.scheduler.schedule()
    try:
        d = dataclasses.asdict(out)
        assert not any(isinstance(v, Sequence) for v in _leaves(d))
        text = json.dumps(out.to_dict())
        back = SchedulerOutput.from_dict(json.loads(text))
        assert back.req_ids == out.req_ids == ["p", "q"] and back.seq_ids == out.seq_ids
        assert back.new_token_ids == [[1, 5, 9, 4, 3], [1, 6]] and back.num_scheduled_tokens == [5, 2]
        assert back.sample == [True, True] and back.pending_src == [None, None]
        assert back.block_tables.tolist() == out.block_tables.tolist()
        assert back.sampling.params == out.sampling.params and back.sampling.seeds == [3, None]
        assert back.sampling.prompt_token_ids == [None, [1, 6]]  # only penalized rows carry their tokens
    finally:
        core.abort_requests([EngineCoreAbort("p"), EngineCoreAbort("q")])
        core.step()
    assert core.kv.usage() == 0.0


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def test_the_kernel_report_is_plain_data_with_reasons(core):
    core.add_request(EngineCoreRequest("k", [1, 5, 9, 4], _greedy(2)))
    _drain(core)
    report = json.loads(json.dumps(core.kernel_report()))
    rows = report["paged_attention"]["decode/1"]
    assert rows and all(r["kernel"] and r["why"] for r in rows)
    assert "prefill/4" in report["paged_attention"]  # the last step with prefill tokens gives its bucket
