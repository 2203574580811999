"""Faults against a live server on 127.0.0.1, each bounded in count and time and each ending everything it
started: 300 streams of which a third leave mid-stream; malformed JSON, wrong content types, oversized and
slow bodies; an abort storm; a killed engine process (needs the engine core in its own process).

After each (:func:`assert_clean`): no 5xx for a valid request, every valid request completed (a
``finish_reason``) or was cancelled by its client, every engine request the server started finished exactly
once (``layerzero:request_success_total``), no request runs or waits, the KV cache is empty
(``layerzero:kv_cache_usage_perc`` 0), no handler is left (the server's ``active`` set), no asyncio task is
left on the server's loop and no thread in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from .conftest import LiveServer, server_args

pytestmark = pytest.mark.integration

BODY_TIMEOUT = 1.0  # --request-body-timeout of the fault server
CONCURRENCY = 32
COMPLETION = {"model": "tiny", "prompt": "hello", "temperature": 0, "ignore_eos": True}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "temperature": 0,
    "ignore_eos": True,
}
JSON_CT = {"Content-Type": "application/json"}


def build(engine: Any, model_dir: str) -> LiveServer:
    from layerzero.engine.entrypoints.openai.api_server import build_app

    args = server_args(
        model_dir,
        served_model_name=["tiny"],
        max_tokens_limit=64,
        max_request_bytes=65536,
        request_body_timeout=BODY_TIMEOUT,
    )
    app = build_app(engine, args)
    live = LiveServer(app)
    live.app = app
    return live


@pytest.fixture(scope="module")
def live(engine, model_dir):
    srv = build(engine, model_dir)
    yield srv
    srv.close()


# ---------------------------------------------------------------------------------------------- probes
def metrics(live: LiveServer) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as ``{(sample name, sorted labels minus model_name): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(live.url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def finished_counts(live: LiveServer) -> dict[str, float]:
    """``layerzero:request_success_total`` by ``finished_reason``."""
    return {
        dict(labels)["finished_reason"]: v
        for (name, labels), v in metrics(live).items()
        if name == "layerzero:request_success_total"
    }


def server_tasks(live: LiveServer) -> set[str]:
    """The asyncio tasks on the server's loop (by their coroutine's name), the probe itself left out."""
    loop = live.server.servers[0].get_loop()

    async def probe() -> set[str]:
        me = asyncio.current_task()
        return {f"{t.get_coro().__qualname__}@{id(t)}" for t in asyncio.all_tasks() if t is not me}

    return asyncio.run_coroutine_threadsafe(probe(), loop).result(10)


_POOLS = ("asyncio_", "ThreadPoolExecutor", "AnyIO worker thread")  # bounded worker pools, reused


def threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if not t.name.startswith(_POOLS)}


class Baseline:
    def __init__(self, live: LiveServer) -> None:
        self.finished = finished_counts(live)
        self.tasks = server_tasks(live)
        self.threads = threads()


def assert_clean(live: LiveServer, engine: Any, base: Baseline, timeout: float = 20.0) -> dict[str, float]:
    """Wait (bounded) until nothing runs, then check nothing leaked; return the finished counts' deltas."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(live)
        kv = m[("layerzero:kv_cache_usage_perc", ())]
        busy = engine.num_running + engine.num_waiting
        active = set(live.app.state.server.active)
        extra = server_tasks(live) - base.tasks
        if not busy and not active and kv == 0 and not extra:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"not clean: {busy=} {active=} kv usage {kv} extra tasks {sorted(extra)[:5]}")
        time.sleep(0.05)
    left = threads() - base.threads
    assert not left, [t.name for t in threading.enumerate() if t.ident in left]
    now = finished_counts(live)
    return {k: now.get(k, 0) - base.finished.get(k, 0) for k in set(now) | set(base.finished)}


# ---------------------------------------------------------------------------------------------- clients
async def stream(client: httpx.AsyncClient, body: dict, path: str, leave_after: int | None) -> str:
    """One streamed request: ``"left"`` after ``leave_after`` events (the connection is closed), else every
    event to ``[DONE]`` (``"done"``: the last choice event had a ``finish_reason``)."""
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        n, fin = 0, None
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                assert fin in ("stop", "length"), fin
                return "done"
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            n += 1
            for c in obj["choices"]:
                fin = c["finish_reason"] or fin
            if leave_after is not None and n >= leave_after:
                return "left"
    raise AssertionError("the stream ended without [DONE]")


async def bounded(coros: list, limit: int = CONCURRENCY) -> list:
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


def client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    return httpx.AsyncClient(base_url="", timeout=60, limits=limits)


# ---------------------------------------------------------------------------------------------- tests
def test_300_streams_a_third_leave_mid_stream(live, engine):
    """300 streams (completions and chat alternately), concurrency 32: 200 read to ``[DONE]`` (8 tokens),
    100 (64 tokens) close their connection after their first event (not later: a slow reader's deltas are
    merged, so under load a whole stream may come as one event); every one of the 300 engine requests
    finishes exactly once, the leavers as ``abort``."""
    base = Baseline(live)
    n_total, leavers = 300, set(range(0, 300, 3))

    async def main() -> list[str]:
        async with client() as c:
            jobs = []
            for i in range(n_total):
                chat = i % 2 == 1
                body = dict(CHAT if chat else COMPLETION, max_tokens=64 if i in leavers else 8, seed=i)
                if not chat:
                    body["prompt"] = f"hello {i}"
                path = live.url + ("/v1/chat/completions" if chat else "/v1/completions")
                jobs.append(stream(c, body, path, 1 if i in leavers else None))
            return await bounded(jobs)

    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert results.count("left") == len(leavers) and results.count("done") == n_total - len(leavers)
    done = assert_clean(live, engine, base)
    assert sum(done.values()) == n_total, done
    assert done.get("abort", 0) >= 0.9 * len(leavers), done  # a leaver may finish its 64 tokens first
    assert done.get("length", 0) >= n_total - len(leavers), done
    assert time.monotonic() - t0 < 150


def test_bad_bodies_content_types_sizes(live, engine):
    """Malformed JSON, wrong content types, oversized bodies (by Content-Length and chunked): OpenAI's error
    object with 400 / 413, never a 5xx; a valid request right after is served."""
    base = Baseline(live)
    url = live.url + "/v1/completions"
    malformed = [b"{", b'{"prompt": "x",}', b"\xff\xfe\x00", b"", b'{"prompt": "x"} tail', b"{'prompt': 'x'}"]
    for body in malformed:
        r = httpx.post(url, content=body, headers=JSON_CT, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    good = json.dumps({**COMPLETION, "max_tokens": 2}).encode()
    for ct in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "image/png",
    ):
        r = httpx.post(url, content=good, headers={"Content-Type": ct}, timeout=30)
        assert r.status_code == 400, (ct, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, data={"prompt": "x"}, timeout=30)  # a real form
    assert r.status_code == 400, r.text
    big = json.dumps({**COMPLETION, "prompt": "x" * 70000}).encode()
    r = httpx.post(url, content=big, headers=JSON_CT, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 8192

    r = httpx.post(url, content=chunks(), headers=JSON_CT, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url, content=good, headers=JSON_CT, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    done = assert_clean(live, engine, base)
    assert sum(done.values()) == 1, done


async def _raw(port: int, head: bytes, pieces: list[bytes], gap: float, limit: float) -> tuple[int, float]:
    """A raw HTTP/1.1 client: send ``head``, then each piece ``gap`` seconds apart (while the server lets
    it); return the status the server answered and when it closed the connection (seconds)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()

        async def trickle() -> None:
            for p in pieces:
                await asyncio.sleep(gap)
                writer.write(p)
                await writer.drain()
            await asyncio.sleep(limit)  # then stall

        sender = asyncio.ensure_future(trickle())
        try:
            data = await asyncio.wait_for(reader.read(), limit)  # to EOF: the server closed it
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
        if status:
            body = json.loads(data.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "request_timeout", body
        return status, time.monotonic() - t0
    finally:
        writer.close()
        await asyncio.gather(writer.wait_closed(), return_exceptions=True)


def test_slow_bodies_get_408_and_the_connection_closes(live, engine):
    """Clients that trickle their body a byte at a time (by Content-Length and chunked) or stall after the
    headers get a 408 and a closed connection within ``--request-body-timeout`` (+1 s); meanwhile a valid
    request is served at once."""
    base = Baseline(live)
    body = json.dumps({**COMPLETION, "max_tokens": 2}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    limit = BODY_TIMEOUT + 4

    async def main():
        slow = [_raw(live.port, head, [bytes([b]) for b in body], 0.1, limit) for _ in range(6)]
        slow += [_raw(live.port, chunked, [b"1\r\n%c\r\n" % b for b in body], 0.1, limit) for _ in range(4)]
        slow += [_raw(live.port, head, [], 0, limit) for _ in range(4)]  # headers, then nothing
        tasks = [asyncio.ensure_future(s) for s in slow]
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=30) as c:
            t0 = time.monotonic()
            r = await c.post(live.url + "/v1/completions", content=body, headers=JSON_CT)
            fast = time.monotonic() - t0
        return await asyncio.gather(*tasks), r, fast

    slow, r, fast = asyncio.run(asyncio.wait_for(main(), 30))
    assert r.status_code == 200 and fast < BODY_TIMEOUT, (r.status_code, fast)
    for status, took in slow:
        assert status == 408 and BODY_TIMEOUT * 0.9 < took < BODY_TIMEOUT + 1.0, (status, took)
    done = assert_clean(live, engine, base)
    assert sum(done.values()) == 1, done  # only the valid request reached the engine


def test_abort_storm(live, engine):
    """200 requests (streamed or not, completions or chat, n 1-2, 1-64 tokens), 70% of them cancelled by
    their client at a random point in their first 0.8 s (the connection is dropped): every request completed
    properly or was cancelled; nothing is left behind."""
    base = Baseline(live)
    rng = random.Random(37)
    outcomes: list[str] = []

    async def one(c: httpx.AsyncClient, i: int) -> None:
        chat = rng.random() < 0.5
        body = dict(CHAT if chat else COMPLETION, max_tokens=rng.randint(1, 64), n=rng.choice([1, 2]), seed=i)
        path = live.url + ("/v1/chat/completions" if chat else "/v1/completions")
        if rng.random() < 0.5:
            work = stream(c, body, path, None)
        else:
            work = c.post(path, json=body)
        task = asyncio.ensure_future(work)
        if rng.random() < 0.7:  # cancelled at a random point (it may have finished by then)
            await asyncio.wait({task}, timeout=rng.uniform(0, 0.8))
            if not task.done():
                task.cancel()
        try:
            res = await task
        except asyncio.CancelledError:
            outcomes.append("cancelled")
            return
        if isinstance(res, httpx.Response):
            assert res.status_code == 200, res.text
            assert all(ch["finish_reason"] in ("stop", "length") for ch in res.json()["choices"])
            outcomes.append("done")
        else:
            outcomes.append(res)

    async def main() -> None:
        async with client() as c:
            await bounded([one(c, i) for i in range(200)])

    asyncio.run(asyncio.wait_for(main(), 120))
    assert len(outcomes) == 200 and set(outcomes) <= {"done", "cancelled"}
    assert outcomes.count("cancelled") >= 20 and outcomes.count("done") >= 20, outcomes
    done = assert_clean(live, engine, base)
    assert done.get("abort", 0) >= 1 and set(done) <= {"stop", "length", "abort"}, done


def test_a_killed_engine_process(engine, engine_factory, model_dir):
    """SIGKILL the engine core while streams and plain requests run: each stream ends with an error event
    and ``[DONE]``, each plain request gets a 503, ``/health`` turns 503, new requests are refused, nothing
    hangs, and the engine's process and the server stop. Runs on its own engine (``engine_factory``)."""
    if getattr(getattr(engine, "_client", None), "proc", None) is None:
        pytest.skip("the engine fixture runs in this process: no engine process to kill")
    eng = engine_factory()
    proc = eng._client.proc
    live = build(eng, model_dir)
    try:
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
        body = {**COMPLETION, "max_tokens": 64}
        started = asyncio.Event

        async def streamed(c: httpx.AsyncClient, ready: Any) -> dict:
            async with c.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        ready.set()
                assert events[-1] == "[DONE]", events[-3:]
                return json.loads(events[-2])

        async def main() -> tuple[list, list]:
            async with client() as c:
                ready = [started() for _ in range(6)]
                s = [asyncio.ensure_future(streamed(c, ev)) for ev in ready]
                p = [asyncio.ensure_future(c.post(live.url + "/v1/completions", json=body)) for _ in range(4)]
                await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in ready)), 30)
                os.kill(proc.pid, signal.SIGKILL)
                return await asyncio.gather(*s), await asyncio.gather(*p)

        ends, plain = asyncio.run(asyncio.wait_for(main(), 60))
        for last in ends:
            assert last["error"]["type"] == "server_error", last
        for r in plain:
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        deadline = time.monotonic() + 10
        while httpx.get(live.url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still answers 200 after the engine died"
            time.sleep(0.05)
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        live.close()
        eng.shutdown()
    proc.join(15)
    assert not proc.is_alive()


class _DropsPromptLogprobs:
    """The engine, except that its outputs never carry prompt logprobs (an engine that lacks them)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kw: Any) -> Any:
        async for out in self._engine.generate(*args, **kw):
            out.prompt_logprobs = None
            yield out


def test_missing_prompt_logprobs_are_an_error_not_nulls(live, engine):
    """``echo`` + ``logprobs`` on an engine that returns no prompt logprobs: a 500 (an error event when
    streamed), never ``token_logprobs`` of nulls a client would sum (lm-eval does). The module's server is
    reused with its engine wrapped (an ``AsyncLLM`` serves one event loop: no second server on it)."""
    state, srv = live.app.state.server, live
    state.engine = _DropsPromptLogprobs(engine)
    try:
        body = {**COMPLETION, "echo": True, "logprobs": 1, "max_tokens": 1}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "prompt logprobs" in r.json()["error"]["message"], r.text
        r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
        events = [e for e in r.text.split("\n\n") if e]
        assert (
            events[-1] == "data: [DONE]"
            and "prompt logprobs" in json.loads(events[-2][6:])["error"]["message"]
        )
        ok = httpx.post(srv.url + "/v1/completions", json={**body, "logprobs": None}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith("hello")
    finally:
        state.engine = engine
