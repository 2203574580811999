"""One engine core serving several front-end processes (``layerzero serve --api-server-count``): the core
process's loop (``EngineCoreProc``) over real zmq sockets, a pair per client, with a stub core. Each
request's outputs go to the client that sent it and to no other; a utility call's result and a refused
request's error go to their sender; stats-only messages to every client; the routing table empties as
completions finish. And ``/metrics`` under ``PROMETHEUS_MULTIPROC_DIR`` sums the front-end counters of
several processes (each process's counters written by itself, then one render)."""

from __future__ import annotations

import multiprocessing

import pytest

import layerzero as lz
from layerzero.engine import SamplingParams
from layerzero.engine.core import serial
from layerzero.engine.core.core_proc import EngineCoreProc
from layerzero.engine.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from layerzero.engine.core.serial import UtilityCall, UtilityResult

zmq = pytest.importorskip("zmq")


class StubCore:
    """Takes requests; :meth:`step` returns what the test queued in ``next_outputs``."""

    def __init__(self) -> None:
        self.requests: dict[str, EngineCoreRequest] = {}
        self.next_outputs: list[EngineCoreOutput] = []

    def add_request(self, r: EngineCoreRequest) -> None:
        if r.request_id in self.requests:
            raise lz.InvalidInputError(f"request_id: expected a new id, got {r.request_id!r}")
        self.requests[r.request_id] = r

    def abort_requests(self, aborts) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.next_outputs)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.requests))

    def step(self) -> EngineCoreOutputs:
        outs, self.next_outputs = self.next_outputs, []
        return EngineCoreOutputs(outs, 1.0, self.get_stats())


@pytest.fixture
def wired():
    """A core loop with two clients: (proc, core, [client push sockets], [client pull sockets])."""
    ctx = zmq.Context()
    socks = []

    def sock(kind, addr, bind):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        (s.bind if bind else s.connect)(addr)
        socks.append(s)
        return s

    ins = [sock(zmq.PULL, f"inproc://in{k}", True) for k in range(2)]
    outs = [sock(zmq.PUSH, f"inproc://out{k}", True) for k in range(2)]
    push = [sock(zmq.PUSH, f"inproc://in{k}", False) for k in range(2)]
    pull = [sock(zmq.PULL, f"inproc://out{k}", False) for k in range(2)]
    core = StubCore()
    yield EngineCoreProc(core, ins, outs, None), core, push, pull
    for s in socks:
        s.close()
    ctx.term()


def _recv(s, timeout_ms: int = 2000):
    if not s.poll(timeout_ms):
        raise AssertionError("expected a message")
    return serial.decode(s.recv())


def _nothing(s) -> bool:
    return not s.poll(50)


def _out(rid: str, i: int, tok: int, finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, i, [tok], None, 0.0, None, finish)


def test_each_request_outputs_go_to_its_sender_only(wired):
    proc, core, push, pull = wired
    push[0].send(serial.encode(EngineCoreRequest("a", [1, 2], SamplingParams(max_tokens=2))))
    push[1].send(serial.encode(EngineCoreRequest("b", [3], SamplingParams(n=2, max_tokens=2))))
    while len(core.requests) < 2:
        proc._drain(block=True)
    assert proc._routes == {"a": [0, 1], "b": [1, 2]}
    core.next_outputs = [_out("a", 0, 7, "length"), _out("b", 0, 8), _out("b", 1, 9, "length")]
    proc.send(core.step())
    got0, got1 = _recv(pull[0]), _recv(pull[1])
    assert [(o.request_id, o.index, o.new_token_ids) for o in got0.outputs] == [("a", 0, [7])]
    assert [(o.request_id, o.index) for o in got1.outputs] == [("b", 0), ("b", 1)]
    assert got0.stats.num_running_reqs == got1.stats.num_running_reqs == 2  # both see the core's stats
    assert proc._routes == {"b": [1, 1]}  # a finished; one completion of b left
    core.next_outputs = [_out("b", 0, 5, "stop")]
    proc.send(core.step())
    assert _recv(pull[0]).outputs == [] and len(_recv(pull[1]).outputs) == 1
    assert proc._routes == {}
    proc.send(EngineCoreOutputs([], 2.0, core.get_stats()))  # gone idle: stats for everyone
    assert _recv(pull[0]).timestamp == _recv(pull[1]).timestamp == 2.0


def test_utility_results_and_refusals_go_to_their_sender(wired):
    proc, core, push, pull = wired
    push[1].send(serial.encode(UtilityCall(5, "get_stats", [])))
    proc._drain(block=True)
    res = _recv(pull[1])
    assert isinstance(res, UtilityResult) and res.call_id == 5 and res.error_type is None
    assert _nothing(pull[0])
    core.requests["dup"] = None  # the next "dup" is refused by the core
    push[0].send(serial.encode(EngineCoreRequest("dup", [1], SamplingParams(n=2))))
    proc._drain(block=True)
    err = _recv(pull[0])
    assert [(o.index, o.finish_reason) for o in err.outputs] == [(0, "error"), (1, "error")]
    assert "expected a new id" in err.outputs[0].error
    assert _nothing(pull[1]) and proc._routes == {}


def test_mismatched_socket_lists_are_refused():
    with pytest.raises(ValueError, match="2 input sockets but 1 outputs"):
        EngineCoreProc(StubCore(), [object(), object()], [object()], None)


def _count(path: str, n: int) -> None:
    import os

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # before prometheus_client is imported in this process
    from layerzero.engine.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    m.generation_tokens.inc(n)
    m.success.labels("tiny", "length").inc()


def test_metrics_sum_over_api_server_processes(tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client")
    from layerzero.engine.entrypoints.openai.metrics import ServerMetrics

    ctx = multiprocessing.get_context("spawn")
    for n in (3, 4):  # two API servers, one after the other (their files stay)
        p = ctx.Process(target=_count, args=(str(tmp_path), n))
        p.start()
        p.join(60)
        assert p.exitcode == 0
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # this process renders what the files hold
    text = ServerMetrics("tiny").render().decode()
    assert 'layerzero:generation_tokens_total{model_name="tiny"} 7.0' in text
    assert 'layerzero:request_success_total{finished_reason="length",model_name="tiny"} 2.0' in text
