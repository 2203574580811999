"""Fixtures of the server tests: the real online engine (``layerzero.engine.AsyncLLM``, its engine core in a
child process), live uvicorn servers on free 127.0.0.1 ports, and the offline ``LLM`` as the independent
oracle.

Every server and every ``AsyncLLM`` of these tests run on one asyncio loop in one background thread
(:func:`serving_loop`): an ``AsyncLLM`` is bound to the loop that uses it, so the servers sharing the engine
must share its loop. Fixtures (stable names, other test modules use them):

- ``model_dir`` (session): the tiny Qwen3 checkpoint's directory.
- ``engine`` (session): the shared ``AsyncLLM`` (one core process for the session; shut down at its end).
  Tests that kill or break an engine start their own with :func:`start_engine` and end it with
  :func:`stop_engine`.
- ``real_engine`` (session): True (``engine`` is a real ``AsyncLLM``, not a double); also ``REAL_ENGINE``.
- ``engine_factory`` (session): ``make(**options)`` -> a new ``AsyncLLM`` (:func:`start_engine`) for a test
  that breaks it.
- ``oracle`` (session): the offline ``LLM`` on the same checkpoint and options.
- ``server`` (module): a :class:`LiveServer` on ``engine`` with ``API_KEY``, served name ``"tiny"``,
  ``max_tokens`` limited to 64 and bodies to 64 KiB (``server.url``, ``server.app``).
- ``client`` (module): the official ``openai.OpenAI`` client on ``server``.

Helpers: :func:`free_port`, :func:`server_args` (the namespace ``layerzero serve`` gives ``build_app``),
:class:`LiveServer` (``app`` served until :meth:`LiveServer.close`), :func:`on_loop` (run a coroutine on the
serving loop from a test, e.g. ``on_loop(engine.get_stats())``), :func:`wait_idle` (no request left in the
engine, KV usage 0), :func:`has_prompt_logprobs` / ``needs_prompt_logprobs`` (skip marker until
``SamplingParams.prompt_logprobs`` exists).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
import torch

from layerzero.engine import LLM, AsyncLLM, SamplingParams

API_KEY = "sk-layerzero-test"
MAX_MODEL_LEN = 256
ENGINE_OPTIONS = dict(dtype=torch.float32, device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
REAL_ENGINE = True
"""The ``engine`` fixture is a real ``AsyncLLM`` (an engine core process), not a double."""


def has_prompt_logprobs() -> bool:
    """Whether ``SamplingParams`` has ``prompt_logprobs`` (echo + logprobs; being added to the engine)."""
    return "prompt_logprobs" in {f.name for f in dataclasses.fields(SamplingParams)}


needs_prompt_logprobs = pytest.mark.skipif(
    not has_prompt_logprobs(),
    reason="SamplingParams has no prompt_logprobs yet (echo + logprobs answers a clean 400 until it lands)",
)

# ------------------------------------------------------------------------------------------ the loop
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def serving_loop() -> asyncio.AbstractEventLoop:
    """The one asyncio loop (a daemon thread) every server and engine of these tests runs on."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="serving-loop", daemon=True).start()
            _LOOP = loop
        return _LOOP


def on_loop(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    """Run ``coro`` on the serving loop and return its result (from a test's thread)."""
    return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), serving_loop()).result(
        timeout + 5
    )


# ------------------------------------------------------------------------------------------ engines
def start_engine(model_dir: str, **options: Any) -> AsyncLLM:
    """A new ``AsyncLLM`` (its own core process) with ``ENGINE_OPTIONS`` updated by ``options``."""
    return AsyncLLM(model_dir, **{**ENGINE_OPTIONS, **options})


def stop_engine(engine: AsyncLLM) -> None:
    """Shut ``engine`` down on the serving loop (where its readers are registered)."""

    async def stop() -> None:
        engine.shutdown()

    on_loop(stop(), 60)


def wait_idle(engine: AsyncLLM, seconds: float = 10.0) -> bool:
    """Wait until the engine holds no request (front end and core) and no KV block; whether it did."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s = on_loop(engine.get_stats())
        if (
            s.num_running_reqs == s.num_waiting_reqs == 0
            and s.kv_cache_usage == 0.0
            and not engine._streams
            and not engine.output_processor.has_unfinished_requests()
        ):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="session")
def model_dir(checkpoints: dict) -> str:
    return str(checkpoints["qwen3"])


@pytest.fixture(scope="session")
def engine(model_dir: str) -> Iterator[AsyncLLM]:
    eng = start_engine(model_dir)
    yield eng
    stop_engine(eng)


@pytest.fixture(scope="session")
def real_engine(engine: Any) -> bool:
    return isinstance(engine, AsyncLLM)


@pytest.fixture(scope="session")
def oracle(model_dir: str) -> LLM:
    """The offline engine on the same checkpoint: what the server's tokens must equal."""
    return LLM(model_dir, **ENGINE_OPTIONS)


# ------------------------------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``app`` served by uvicorn on 127.0.0.1, on the serving loop; :meth:`close` stops it."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.future = asyncio.run_coroutine_threadsafe(self.server.serve(), serving_loop())
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or self.future.done():
                if self.future.done() and self.future.exception() is not None:
                    raise RuntimeError("uvicorn did not start") from self.future.exception()
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.future.result(30)


def server_args(model_dir: str, **kw: Any) -> Any:
    """The namespace ``layerzero serve`` would give ``build_app`` (server flags only)."""
    import argparse

    from layerzero.engine.entrypoints.openai.api_server import add_server_args

    ns = add_server_args(argparse.ArgumentParser()).parse_args([])
    ns.model = model_dir
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


@pytest.fixture(scope="module")
def server(engine: AsyncLLM, model_dir: str) -> Iterator[LiveServer]:
    """The server the tests talk to: API key set, ``max_tokens`` limited to 64, bodies to 64 KiB."""
    from layerzero.engine.entrypoints.openai.api_server import build_app

    args = server_args(
        model_dir, api_key=API_KEY, served_model_name=["tiny"], max_tokens_limit=64, max_request_bytes=65536
    )
    live = LiveServer(build_app(engine, args))
    yield live
    live.close()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[Any]:
    import openai

    c = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="session")
def engine_factory(model_dir: str) -> Any:
    """Builds another engine of the ``engine`` fixture's kind on the same checkpoint (:func:`start_engine`),
    for a test that breaks it (kills its process, ``engine._client.proc``); the test shuts it down
    (:func:`stop_engine`, or ``shutdown()``)."""

    def make(**options: Any) -> AsyncLLM:
        return start_engine(model_dir, **options)

    return make
