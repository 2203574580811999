"""The engine core's idle wait (``idle_poll_s``): it polls its input without blocking until a message comes or
``idle_poll_s`` seconds have passed since its last step, then blocks; 0 blocks at once. A fake clock and a
recording ``_drain`` make the sequence of calls exact; a real ``AsyncLLM`` (fake core) with polling on still
answers, aborts and goes idle. ``idle_poll_s`` is validated like every option and set by ``--idle-poll-s``."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import zmq

import layerzero as lz
from layerzero.cli_engine import add_engine_args, engine_kwargs
from layerzero.engine import SamplingParams
from layerzero.engine.config import EngineConfig
from layerzero.engine.core.core_proc import EngineCoreProc

from .fake_core import fake_engine


class Clock:
    """Reads 0.1 s later each time it is read."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.1
        return self.t


def _proc(idle: float, answers: list[bool]) -> tuple[EngineCoreProc, list[bool], zmq.Context]:
    """A core loop on inproc sockets whose ``_drain`` records its ``block`` flags and answers from
    ``answers`` (then False)."""
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.bind("inproc://idle-in")
    out.bind("inproc://idle-out")
    proc = EngineCoreProc(object(), inp, out, None, idle, clock=Clock())
    calls: list[bool] = []

    def drain(block: bool) -> bool:
        calls.append(block)
        return answers.pop(0) if answers else False

    proc._drain = drain  # type: ignore[method-assign]
    return proc, calls, ctx


def _close(proc: EngineCoreProc, ctx: zmq.Context) -> None:
    proc.input.close(linger=0)
    proc.output.close(linger=0)
    ctx.term()


def test_polls_without_blocking_until_the_window_ends_then_blocks():
    proc, calls, ctx = _proc(0.5, [])
    try:
        # last step at 0.1 (the constructor's read); the window ends at 0.6; the clock reads 0.2, 0.3, ...
        assert proc._wait_idle() is False
        assert calls == [False] * 4 + [True]  # non-blocking polls at 0.2..0.5, then one blocking wait
    finally:
        _close(proc, ctx)


def test_a_message_while_polling_returns_at_once():
    proc, calls, ctx = _proc(10.0, [False, False, True])
    try:
        assert proc._wait_idle() is True and calls == [False, False, False]
    finally:
        _close(proc, ctx)


def test_zero_blocks_at_once():
    proc, calls, ctx = _proc(0.0, [])
    try:
        assert proc._wait_idle() is False and calls == [True]
    finally:
        _close(proc, ctx)


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "1"])
def test_bad_idle_poll_s_is_a_configuration_error(bad):
    with pytest.raises(lz.ConfigurationError, match="idle_poll_s"):
        EngineConfig("model", idle_poll_s=bad)


def test_flag_sets_the_keyword():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--model", "m", "--idle-poll-s", "0.25"]))["idle_poll_s"] == 0.25
    assert engine_kwargs(p.parse_args(["--model", "m"]))["idle_poll_s"] is None
    assert EngineConfig("model", idle_poll_s=0).idle_poll_s == 0


@pytest.mark.integration
def test_engine_with_polling_on_answers_and_goes_idle(checkpoints):
    eng = fake_engine(checkpoints["qwen3"], max_model_len=200, num_kv_blocks=64, idle_poll_s=0.3)

    async def main():
        sp = SamplingParams(max_tokens=4, ignore_eos=True)
        first = [o async for o in eng.generate([5, 6, 7], sp, "a")]
        await asyncio.sleep(0.5)  # past the window: the core blocks; the next request wakes it
        second = [o async for o in eng.generate([5, 6, 7], sp, "b")]
        return first, second

    try:
        first, second = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        eng.shutdown()
    toks = [t for o in first for c in o.outputs for t in c.token_ids]
    assert len(toks) == 4 and [t for o in second for c in o.outputs for t in c.token_ids] == toks
    assert first[-1].finished and second[-1].finished
