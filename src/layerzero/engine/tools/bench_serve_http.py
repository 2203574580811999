"""The HTTP client of ``layerzero bench-serve``: aiohttp when it is installed (the client of vLLM's and
SGLang's serving benchmarks), else httpx (the serve extra's). Both speak the same small interface
(:class:`Client`): a JSON ``GET`` and a streamed ``POST`` read line by line. The client's own overhead is part
of every time to first token a benchmark reports; on an H200 host httpx's asyncio client put 3.6 ms between
the server's own ``ttft_s`` and the measured one at 1 req/s (benchmarks/results/serving/README.md), and on the
2-core VM aiohttp measured 1.3 ms less than httpx against the same server
(benchmarks/results/serving/README.md, 2026-11-30).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ..errors import bad_config

__all__ = ["HTTP_CLIENTS", "Client", "TransportError", "resolve_client"]

HTTP_CLIENTS = ("auto", "aiohttp", "httpx")
"""``BenchServeConfig.http_client``: ``auto`` picks aiohttp when installed, else httpx."""


class TransportError(Exception):
    """The request did not complete at the HTTP level (refused, reset, timed out); ``kind`` is the client
    library's exception name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @classmethod
    def of(cls, exc: BaseException) -> TransportError:
        """The client library's exception ``exc`` as a :class:`TransportError` (its name as ``kind``)."""
        return cls(type(exc).__name__, str(exc) or type(exc).__name__)


def resolve_client(name: str) -> str:
    """The client library ``name`` (one of :data:`HTTP_CLIENTS`) means here.

    Raises:
        ConfigurationError: an unknown name, or a library asked for by name that is not installed.
    """
    if name not in HTTP_CLIENTS:
        raise bad_config("bench-serve http_client", f"one of {HTTP_CLIENTS}", repr(name))
    have = {lib: importlib.util.find_spec(lib) is not None for lib in ("aiohttp", "httpx")}
    if name == "auto":
        name = "aiohttp" if have["aiohttp"] else "httpx"
    if not have[name]:
        raise bad_config(
            "bench-serve http_client", f"{name} installed", "not installed", f"pip install {name}"
        )
    return name


class Client:
    """One connection pool of ``kind`` (``aiohttp`` or ``httpx``) for up to ``n_conn`` requests at once,
    each allowed ``timeout_s`` seconds (connecting: at most 30). Use as ``async with``."""

    def __init__(self, kind: str, n_conn: int, timeout_s: float) -> None:
        self.kind, self.n_conn, self.timeout_s = kind, n_conn, timeout_s
        self._c: Any = None

    async def __aenter__(self) -> Client:
        if self.kind == "aiohttp":
            import aiohttp

            conn = aiohttp.TCPConnector(limit=self.n_conn + 4)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, connect=min(self.timeout_s, 30.0))
            self._c = aiohttp.ClientSession(connector=conn, timeout=timeout)
        else:
            import httpx

            limits = httpx.Limits(max_connections=self.n_conn + 4, max_keepalive_connections=self.n_conn + 4)
            timeout = httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 30.0))
            self._c = httpx.AsyncClient(timeout=timeout, limits=limits)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await (self._c.close() if self.kind == "aiohttp" else self._c.aclose())

    def _errors(self) -> tuple[type[BaseException], ...]:
        if self.kind == "aiohttp":
            import asyncio

            import aiohttp

            return (aiohttp.ClientError, asyncio.TimeoutError)
        import httpx

        return (httpx.HTTPError,)

    async def get_json(self, url: str, headers: dict[str, str]) -> tuple[int, Any]:
        """``(status, parsed JSON body or None when it is not JSON)`` of ``GET url``.

        Raises:
            TransportError: the request failed below HTTP."""
        try:
            if self.kind == "aiohttp":
                async with self._c.get(url, headers=headers) as r:
                    status, text = r.status, await r.text()
            else:
                r = await self._c.get(url, headers=headers)
                status, text = r.status_code, r.text
        except self._errors() as exc:
            raise TransportError.of(exc) from exc
        try:
            return status, json.loads(text)
        except ValueError:
            return status, None

    @asynccontextmanager
    async def stream(
        self, url: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> AsyncIterator[tuple[int, AsyncIterator[str]]]:
        """``POST url`` with ``payload`` as JSON: yields ``(status, the body's lines without line ends)``.

        Raises:
            TransportError: the request failed below HTTP (also while reading lines)."""
        errors = self._errors()
        try:
            if self.kind == "aiohttp":
                async with self._c.post(url, json=payload, headers=headers) as r:
                    yield r.status, _wrap(_aiohttp_lines(r), errors)
            else:
                async with self._c.stream("POST", url, json=payload, headers=headers) as r:
                    yield r.status_code, _wrap(r.aiter_lines(), errors)
        except errors as exc:
            raise TransportError.of(exc) from exc


async def _aiohttp_lines(r: Any) -> AsyncIterator[str]:
    async for raw in r.content:  # one line per iteration, its b"\n" kept
        yield raw.decode("utf-8", "replace").rstrip("\r\n")


async def _wrap(lines: AsyncIterator[str], errors: tuple[type[BaseException], ...]) -> AsyncIterator[str]:
    try:
        async for line in lines:
            yield line
    except errors as exc:
        raise TransportError.of(exc) from exc
