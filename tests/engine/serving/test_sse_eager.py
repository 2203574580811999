"""``EagerStream`` / ``SSEResponse``: a stream's first item is computed from the next turn of the loop, before
anybody iterates it (the engine request reaches the core while the response starts), and an abandoned stream
is closed: its pending first item cancelled, its generator's ``finally`` run (where the engine request
aborts)."""

from __future__ import annotations

import asyncio

import pytest

from layerzero.engine.entrypoints.openai.sse import EagerStream, SSEResponse


def _gen(log: list[str], gate: asyncio.Event | None = None):
    async def gen():
        log.append("started")
        try:
            if gate is not None:
                await gate.wait()
            yield b"a"
            yield b"b"
        finally:
            log.append("closed")

    return gen()


def test_first_item_is_computed_before_iteration_then_all_items_in_order():
    async def main():
        log: list[str] = []
        s = EagerStream(_gen(log))
        assert log == []  # nothing runs inside the constructor
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert log == ["started"]  # begun with nobody iterating
        items = [x async for x in s]
        await s.aclose()
        return log, items

    log, items = asyncio.run(main())
    assert items == [b"a", b"b"] and log == ["started", "closed"]


def test_abandoned_stream_cancels_its_pending_first_item_and_runs_finally():
    async def main():
        log: list[str] = []
        gate = asyncio.Event()  # never set: the first item stays pending (an engine request in prefill)
        s = EagerStream(_gen(log, gate))
        await asyncio.sleep(0)
        await s.aclose()
        return log, s.first

    log, first = asyncio.run(main())
    assert log == ["started", "closed"] and first is None


def test_error_before_the_first_item_reaches_the_consumer():
    async def bad():
        raise ValueError("engine said no")
        yield b""  # pragma: no cover - makes this an async generator

    async def main():
        s = EagerStream(bad())
        with pytest.raises(ValueError, match="engine said no"):
            await s.__anext__()
        await s.aclose()

    asyncio.run(main())


def test_sse_response_starts_its_body_and_closes_it_when_the_client_leaves():
    async def main():
        log: list[str] = []
        gate = asyncio.Event()
        resp = SSEResponse(_gen(log, gate))
        await asyncio.sleep(0)
        assert log == ["started"]
        sent: list[dict] = []

        async def receive():  # the client is gone at once
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)

        await resp({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return log

    assert asyncio.run(main()) == ["started", "closed"]
