"""Server-sent events and client disconnects.

A stream is ``data: {json}\\n\\n`` chunks, then ``data: [DONE]\\n\\n``; an error after the stream started is
one ``data: {"error": {...}}`` chunk before ``[DONE]`` (the status is already 200). A client that disconnects
cancels the handler at once, streaming or not (:class:`SSEResponse`, :func:`until_disconnect`), so the engine
request's ``finally`` aborts it within a step instead of when the next chunk fails to send.

A stream starts at once: :class:`SSEResponse` begins computing its first chunk (which sends the engine
request to the core) when it is built, not when Starlette first iterates it, so the engine's prefill runs
while the response's headers are sent (:class:`EagerStream`); the response always closes it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

__all__ = ["DONE", "EagerStream", "SSEResponse", "event", "until_disconnect"]

DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class EagerStream:
    """``body`` (an async generator) started now: its first item is computed by a task from the next turn of
    the loop, while the caller goes on (e.g. builds and starts the response); iteration returns that item,
    then the rest. :meth:`aclose` cancels the first item if it is still pending and closes ``body`` (the
    engine request aborts itself), so it must be called when the stream is abandoned."""

    def __init__(self, body: AsyncIterator[Any]) -> None:
        self.body = body
        self.first: asyncio.Future[Any] | None = asyncio.ensure_future(body.__anext__())

    def __aiter__(self) -> EagerStream:
        return self

    async def __anext__(self) -> Any:
        first, self.first = self.first, None
        if first is not None:
            return await first  # StopAsyncIteration and errors come through
        return await self.body.__anext__()

    async def aclose(self) -> None:
        first, self.first = self.first, None
        if first is not None:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        aclose = getattr(self.body, "aclose", None)
        if aclose is not None:
            await aclose()


def _response_classes() -> Any:
    from starlette.responses import StreamingResponse

    class _SSE(StreamingResponse):
        """A streaming response that also listens for the client's disconnect and cancels the stream when it
        comes (Starlette does this only for ASGI servers older than spec 2.4)."""

        media_type = "text/event-stream"

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            stream = asyncio.ensure_future(self.stream_response(send))
            gone = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (stream, gone):
                    t.cancel()
                res = await asyncio.gather(stream, gone, return_exceptions=True)
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:  # a stream cut short (the client left) ends its engine request
                    await aclose()
            if isinstance(res[0], Exception) and not isinstance(res[0], OSError | asyncio.CancelledError):
                raise res[0]

    return _SSE


def SSEResponse(body: AsyncIterator[bytes]) -> Any:  # noqa: N802 - a response class, built lazily
    """A ``text/event-stream`` response of ``body`` (an async generator, started now: :class:`EagerStream`)
    that cancels and closes it when the client leaves. Call it inside the running loop and return it (the
    response's ``__call__`` closes the stream)."""
    return _response_classes()(
        EagerStream(body), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def until_disconnect(request: Any, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (its engine requests abort) and return a
    499 response nobody will read."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        from starlette.responses import Response

        return Response(status_code=499)
    return task.result()
