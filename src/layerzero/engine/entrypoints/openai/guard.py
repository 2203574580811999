"""The ASGI middleware in front of every route: the API key, the body size and the body's arrival time.

- Every HTTP request's arrival (``time.monotonic()`` before anything else runs) is put in its scope under
  :data:`ARRIVAL`: the server's time to first token counts from there.
- With an API key set, every route but ``/health`` needs ``Authorization: Bearer <key>`` (compared with
  ``hmac.compare_digest``: constant time); otherwise 401 ``invalid_api_key``.
- A body over ``max_request_bytes`` is a 413 ``request_too_large``: a ``Content-Length`` over the limit is
  refused before reading anything, and a body without one (chunked) is counted as it arrives and refused as
  soon as it passes the limit. A body under the limit is read whole and handed to the app (bodies are small
  JSON documents).
- A body must arrive whole within ``request_body_timeout`` seconds of the request's start (a total deadline,
  not an idle one, so a client that trickles a byte at a time cannot hold a connection and its buffers open
  for ever): otherwise 408 ``request_timeout`` and the connection is closed (``Connection: close``).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

from .errors import OpenAIError
from .responses import OPEN_ROUTES

__all__ = ["ARRIVAL", "Guard", "arrival_of"]

ARRIVAL = "layerzero.arrival"
"""The ASGI scope key (an extension key) of the request's arrival, ``time.monotonic()`` seconds."""


def arrival_of(request: Any) -> float | None:
    """The arrival :class:`Guard` stamped on ``request`` (a Starlette ``Request``), None without one."""
    scope = getattr(request, "scope", None)
    return scope.get(ARRIVAL) if isinstance(scope, dict) else None


class Guard:
    """Pure ASGI middleware (no buffering of responses, so streams pass straight through)."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        max_request_bytes: int | None,
        request_body_timeout: float | None = None,
    ) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max = max_request_bytes
        self.timeout = request_body_timeout if request_body_timeout and request_body_timeout > 0 else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVAL] = time.monotonic()
        headers = dict(scope.get("headers") or ())
        if self.key is not None and scope.get("path") not in OPEN_ROUTES:
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                msg = (
                    "Incorrect API key provided."
                    if token
                    else "You didn't provide an API key: send 'Authorization: Bearer <key>'."
                )
                err = OpenAIError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        if self.max is None and self.timeout is None:
            await self.app(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                await OpenAIError(400, "Invalid Content-Length header.").response()(scope, receive, send)
                return
            if self.max is not None and int(length) > self.max:
                await self._too_large(scope, receive, send)
                return
        chunks, total = [], 0
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            try:
                if deadline is None:
                    msg = await receive()
                else:
                    msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                await self._too_slow(scope, receive, send)
                return
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if self.max is not None and total > self.max:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_slow(self, scope: dict, receive: Any, send: Any) -> None:
        err = OpenAIError(
            408,
            f"The request body did not arrive within {self.timeout:g} s (--request-body-timeout).",
            code="request_timeout",
            headers={"Connection": "close"},
        )
        await err.response()(scope, receive, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        err = OpenAIError(
            413,
            f"The request body is over this server's limit of {self.max} bytes.",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await err.response()(scope, receive, send)
