"""AsyncLLM when the engine core process fails: killed (SIGKILL), a step that raises, a core that cannot
start, shutdown with requests in flight, an interpreter that exits without shutdown, a front end that is
killed. Every stream ends with a typed error within a bounded time, nothing hangs, no process is left
behind."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import layerzero as lz
from layerzero.engine import EngineDeadError, SamplingParams
from layerzero.engine.core.errors import EngineCoreError

from . import fake_core
from .fake_core import fake_engine

pytestmark = pytest.mark.integration
SRC = Path(__file__).resolve().parents[3] / "src"
TESTS = Path(__file__).resolve().parents[3] / "tests"


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts: nothing runs)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if gone(pid):
            return True
        time.sleep(0.05)
    return False


def start(checkpoints, name="SlowFakeEngineCore", **kw):
    return fake_engine(checkpoints["qwen3"], name, max_model_len=128, **kw)


def assert_cleaned_up(engine):
    client = engine._client
    client.proc.join(15)
    assert wait_gone(client.proc.pid)
    assert client.proc not in multiprocessing.active_children()
    assert not os.path.exists(client._tmp)


async def stream_until_error(engine, rid, started: asyncio.Event):
    n = 0
    try:
        async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=100_000), rid):
            n += 1
            if n == 2:
                started.set()
    except EngineDeadError as exc:
        return exc
    return None


async def storm_then(engine, action, k: int = 6):
    evs = [asyncio.Event() for _ in range(k)]
    tasks = [asyncio.create_task(stream_until_error(engine, f"r{i}", evs[i])) for i in range(k)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in evs)), 30)
    t0 = time.monotonic()
    action()
    errors = await asyncio.wait_for(asyncio.gather(*tasks), 15)
    return errors, time.monotonic() - t0


def test_killed_core_fails_every_stream(checkpoints):
    engine = start(checkpoints)
    pid = engine._client.info["pid"]
    assert pid == engine._client.proc.pid

    async def main():
        errors, took = await storm_then(engine, lambda: os.kill(pid, signal.SIGKILL))
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert "died" in str(errors[0]) and took < 5.0
        assert engine.errored and not engine.is_running and engine.dead_error is errors[0]
        with pytest.raises(EngineDeadError):
            await engine.generate([1], SamplingParams(), "after").__anext__()
        with pytest.raises(EngineDeadError):
            await engine.get_stats()
        with pytest.raises(EngineDeadError):
            await engine.abort("r0")

    asyncio.run(main())
    engine.shutdown()
    engine.shutdown()
    assert_cleaned_up(engine)
    assert isinstance(EngineDeadError("x"), RuntimeError) and isinstance(
        EngineDeadError("x"), lz.LayerZeroError
    )


def test_dead_core_is_seen_without_a_loop(checkpoints):
    engine = start(checkpoints)
    os.kill(engine._client.proc.pid, signal.SIGKILL)
    engine._client.proc.join(15)
    assert engine.errored and "died" in str(engine.dead_error)
    engine.shutdown()
    assert_cleaned_up(engine)


def test_failing_step_fails_every_stream(checkpoints):
    engine = start(checkpoints, "CrashingFakeEngineCore")

    async def main():
        with pytest.raises(EngineDeadError, match="step failed"):
            async for _ in engine.generate([1, 2], SamplingParams(max_tokens=100), "x"):
                pass

    asyncio.run(asyncio.wait_for(main(), 30))
    assert engine.errored
    assert wait_gone(engine._client.proc.pid) and engine._client.proc.exitcode == 1
    engine.shutdown()
    assert_cleaned_up(engine)


def test_start_up_errors_are_typed(checkpoints):
    before = set(multiprocessing.active_children())
    with pytest.raises(lz.ConfigurationError, match="expected <= 64, got 65"):
        start(checkpoints, "FailingFakeEngineCore")
    with pytest.raises(EngineCoreError, match="OSError: fake core: no such device") as ei:
        start(checkpoints, "BrokenFakeEngineCore")
    assert ei.value.remote_type == "OSError"
    assert set(multiprocessing.active_children()) <= before


def test_bad_options_fail_before_any_process(checkpoints):
    from layerzero.engine import AsyncLLM

    before = set(multiprocessing.active_children())
    with pytest.raises(lz.ConfigurationError, match="max_num_seqs"):
        AsyncLLM(checkpoints["qwen3"], max_num_seqs=0)
    with pytest.raises(TypeError, match="no_such_option"):
        AsyncLLM(checkpoints["qwen3"], no_such_option=1)
    assert set(multiprocessing.active_children()) == before


def test_shutdown_with_requests_in_flight(checkpoints):
    engine = start(checkpoints)

    async def main():
        async with engine:
            errors, took = await storm_then(engine, engine.shutdown, k=4)
        assert all(isinstance(e, EngineDeadError) and "shut down" in str(e) for e in errors)
        assert not engine.errored and not engine.is_running

    asyncio.run(main())
    assert_cleaned_up(engine)
    engine.shutdown()


def run_script(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS)]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


SCRIPT = """
    import os, signal
    from layerzero.engine import EngineConfig
    from layerzero.engine.core.core_client import MPClient

    if __name__ == "__main__":
        c = MPClient(EngineConfig("/nonexistent"), core_factory="engine.unit.fake_core:FakeEngineCore")
        c.wait_ready()
        print(c.proc.pid, c._tmp, flush=True)
        {end}
"""


@pytest.mark.parametrize("end", ["pass", "os.kill(os.getpid(), signal.SIGKILL)"], ids=["exit", "killed"])
def test_core_ends_with_its_front_end(end):
    """The interpreter exits without shutdown(): the core is stopped and its directory removed (finalizer).
    The front end is SIGKILLed: the core sees its parent's sentinel and exits."""
    assert fake_core.__name__.endswith("engine.unit.fake_core")
    t0 = time.monotonic()
    out = run_script(SCRIPT.replace("{end}", end))
    pid_s, tmp = out.stdout.split()
    assert wait_gone(int(pid_s), 15.0), out.stderr
    if end == "pass":
        assert out.returncode == 0 and not os.path.exists(tmp), out.stderr
    else:
        assert out.returncode == -signal.SIGKILL
    assert time.monotonic() - t0 < 60
