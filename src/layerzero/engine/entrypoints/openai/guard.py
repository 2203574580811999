"""The ASGI middleware in front of every route: the API key and the body size.

- With an API key set, every route but ``/health`` needs ``Authorization: Bearer <key>`` (compared with
  ``hmac.compare_digest``: constant time); otherwise 401 ``invalid_api_key``.
- A body over ``max_request_bytes`` is a 413 ``request_too_large``: a ``Content-Length`` over the limit is
  refused before reading anything, and a body without one (chunked) is counted as it arrives and refused as
  soon as it passes the limit. A body under the limit is read whole and handed to the app (bodies are small
  JSON documents).
"""

from __future__ import annotations

import hmac
from typing import Any

from .errors import OpenAIError

__all__ = ["Guard"]

_OPEN = frozenset({"/health"})


class Guard:
    """Pure ASGI middleware (no buffering of responses, so streams pass straight through)."""

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max = max_request_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if self.key is not None and scope.get("path") not in _OPEN:
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
        if self.max is None:
            await self.app(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                await OpenAIError(400, "Invalid Content-Length header.").response()(scope, receive, send)
                return
            if int(length) > self.max:
                await self._too_large(scope, receive, send)
                return
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max:
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

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        err = OpenAIError(
            413,
            f"The request body is over this server's limit of {self.max} bytes.",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await err.response()(scope, receive, send)
