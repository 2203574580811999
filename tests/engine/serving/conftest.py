"""Fixtures of the server tests: an engine behind the ``AsyncLLM`` interface, a live uvicorn server on a free
127.0.0.1 port (in a thread, stopped by its fixture) and the offline ``LLM`` as the independent oracle.

TEMPORARY: :class:`EngineDouble` stands in for ``layerzero.engine.AsyncLLM`` (issue 37, being written in
parallel in ``src/layerzero/engine/async_llm.py``). It implements exactly the interface the server uses, on
the real synchronous ``LLM`` (one driver thread runs the steps, so requests join the running batch), so the
tests exercise the real model, tokenizer, sampler and detokenizer. When ``AsyncLLM`` lands, the ``engine``
fixture builds it instead and this class is deleted. ``SamplingParams.prompt_logprobs`` is also being added
in parallel: until then :func:`_params_with_prompt_logprobs` gives the server a subclass carrying it, and the
double computes prompt logprobs with transformers on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from layerzero.engine import LLM, SamplingParams
from layerzero.engine.core.messages import SchedulerStats

API_KEY = "sk-layerzero-test"
MAX_MODEL_LEN = 256
ENGINE_OPTIONS = dict(dtype=torch.float32, device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=32)


class EngineDouble:
    """``AsyncLLM``'s interface on the offline engine (see the module docstring; replaced by the real one)."""

    def __init__(self, model: str, **options: Any) -> None:
        self.model_dir = model
        self.llm = LLM(model, **options)
        self._eng = self.llm.engine
        self.model_config = self._eng.model_config
        self.max_model_len = self._eng.max_model_len
        self.is_running, self.errored, self.dead_error = True, False, None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, tuple[Any, Any, asyncio.Queue]] = {}
        self._hf: Any = None
        self._thread = threading.Thread(target=self._drive, name="engine-double", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def num_waiting(self) -> int:
        return len(self._eng.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self._eng.scheduler.running)

    def validate(
        self, prompt: Any, params: SamplingParams, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        return self._eng.validate(prompt, params, priority)

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, *, priority: int = 0
    ):
        text, ids = self.validate(prompt, sampling_params, priority)
        n_plp = getattr(sampling_params, "prompt_logprobs", None)
        plp = None if n_plp is None else await asyncio.to_thread(self._prompt_logprobs, ids, n_plp)
        aq: asyncio.Queue = asyncio.Queue()
        self._cmds.put(
            ("add", request_id, (text, ids, sampling_params, priority), asyncio.get_running_loop(), aq)
        )
        finished, first = False, True
        try:
            while not finished:
                out = await aq.get()
                if isinstance(out, BaseException):
                    raise out
                if first:
                    out.prompt_logprobs, first = plp, False
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._cmds.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    async def get_stats(self) -> SchedulerStats:
        s = self._eng.stats
        return SchedulerStats(
            num_running_reqs=self.num_running,
            num_waiting_reqs=self.num_waiting,
            kv_cache_usage=float(self._eng.kv.usage()),
            num_preemptions=s.preemptions,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
        )

    async def kernel_report(self) -> dict:
        return {"model": self.model_dir, "ops": {}}

    def shutdown(self) -> None:
        self.is_running = False
        self._cmds.put(("stop",))
        self._thread.join(30)

    # ------------------------------------------------------------------------------------------ internals
    def _prompt_logprobs(self, ids: list[int], top_n: int) -> list[dict[int, float] | None]:
        """The prompt's logprobs from transformers on the same checkpoint (top-N plus the actual token)."""
        from transformers import AutoModelForCausalLM

        if self._hf is None:
            self._hf = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logp = torch.log_softmax(self._hf(torch.tensor([ids])).logits[0].double(), -1)
        out: list[dict[int, float] | None] = [None]
        for i in range(1, len(ids)):
            row = logp[i - 1]
            d = {int(t): float(row[t]) for t in torch.topk(row, top_n).indices} if top_n else {}
            d[ids[i]] = float(row[ids[i]])
            out.append(d)
        return out

    def _deliver(self, loop: Any, aq: asyncio.Queue, item: Any) -> None:
        try:
            loop.call_soon_threadsafe(aq.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody waits
            pass

    def _drive(self) -> None:
        eng = self._eng
        while True:
            try:
                cmd = self._cmds.get(timeout=0.02 if not eng.has_unfinished() else 0)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    for rid in list(self._live):
                        eng.abort(rid)
                    return
                if cmd[0] == "add":
                    _, rid, (text, ids, sp, prio), loop, aq = cmd
                    try:
                        self._live[rid] = (eng.enqueue(text, ids, sp, prio, rid), loop, aq)
                    except Exception as exc:
                        self._deliver(loop, aq, exc)
                elif cmd[0] == "abort":
                    eng.abort(cmd[1])
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if eng.has_unfinished():
                eng.step()
            for rid, (req, loop, aq) in list(self._live.items()):
                if eng.has_news(req):
                    out = eng.output(req, delta=True)
                    if out.finished or any(o.text or o.token_ids for o in out.outputs):
                        self._deliver(loop, aq, out)
                    if out.finished:
                        del self._live[rid]


@dataclasses.dataclass(frozen=True)
class _ParamsWithPromptLogprobs(SamplingParams):
    """TEMPORARY: ``SamplingParams`` plus ``prompt_logprobs`` until the engine's has it."""

    prompt_logprobs: int | None = None


@pytest.fixture(scope="session", autouse=True)
def _params_with_prompt_logprobs() -> Iterator[None]:
    from layerzero.engine.entrypoints.openai import serving

    if "prompt_logprobs" in {f.name for f in dataclasses.fields(SamplingParams)}:
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setattr(serving, "SamplingParams", _ParamsWithPromptLogprobs)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def model_dir(checkpoints: dict) -> str:
    return str(checkpoints["qwen3"])


@pytest.fixture(scope="session")
def engine(model_dir: str) -> Iterator[EngineDouble]:
    eng = EngineDouble(model_dir, **ENGINE_OPTIONS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def oracle(model_dir: str) -> LLM:
    """The offline engine on the same checkpoint: what the server's tokens must equal."""
    return LLM(model_dir, **ENGINE_OPTIONS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``app`` served by uvicorn on 127.0.0.1 in a thread; :meth:`close` stops it and joins the thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        if self.thread.is_alive():
            raise RuntimeError("uvicorn did not stop")


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
def server(engine: EngineDouble, model_dir: str) -> Iterator[LiveServer]:
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
    """Builds another engine of the ``engine`` fixture's kind on the same checkpoint, for a test that breaks
    it (kills its process); the test shuts it down. An engine with its core in another process exposes it
    as ``engine._client.proc``; the EngineDouble has none (such tests skip)."""

    def make() -> Any:
        return EngineDouble(model_dir, **ENGINE_OPTIONS)

    return make
