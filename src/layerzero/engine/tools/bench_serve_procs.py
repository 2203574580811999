"""``layerzero bench-serve --client-processes K``: one benchmark run sent from ``K`` client processes.

One Python process reading streamed completions tops out at some tens of thousands of SSE chunks a second
(measured on an H200 host: one client held two data-parallel replicas to 31,100 output tok/s, two clients
took the same server to 45,400): past that the benchmark measures itself. Request ``i`` goes to process
``i % K`` (same requests, lengths and arrival times as one process: :func:`~.bench_serve.make_requests`,
:func:`~.bench_serve.arrival_times`); ``max_concurrency`` is split between the processes (each caps its own
share, so the cap is no longer work-conserving across them). The processes (``spawn``) first build their
HTTP clients, then meet at a barrier; the parent sets the common start (wall clock), and each process times
its requests on its own ``perf_counter`` from that start. The run's duration is from the start to the last
process's end; the summary is computed over all requests at once, as for one process.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from collections.abc import Iterator
from typing import Any

from ..errors import bad_config
from .bench_serve import BenchServeConfig, discover, report, run_loop, send_requests
from .bench_serve_http import Client

__all__ = ["collect", "run_processes", "shares"]

_SETUP_TIMEOUT_S = 120.0  # a client process that is not ready by then (import, HTTP client) fails the run
_POLL_S = 1.0  # how often the parent looks for a client process that ended without a report


def shares(total: int | None, parts: int) -> list[int | None]:
    """``total`` split into ``parts`` near-equal ints (the first ones one larger); None stays None."""
    if total is None:
        return [None] * parts
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


async def _part(
    cfg: BenchServeConfig, reqs: Any, k: int, model: str, kind: str, cap: int | None, sync: Any
) -> Any:
    indices = range(k, len(reqs), cfg.client_processes)
    async with Client(kind, cap or len(indices), cfg.request_timeout_s) as client:
        ready, go, start_wall = sync
        ready.wait(_SETUP_TIMEOUT_S)
        go.wait(_SETUP_TIMEOUT_S)
        start = time.perf_counter() + (start_wall.value - time.time())
        results = await send_requests(client, cfg, model, reqs, indices, start, cap)
    return list(indices), results, time.time()


def _worker(
    cfg: BenchServeConfig, reqs: Any, k: int, model: str, kind: str, cap: int | None, sync: Any, out: Any
) -> None:
    try:
        out.put(("ok", run_loop(_part(cfg, reqs, k, model, kind, cap, sync))))
    except BaseException as exc:  # the parent raises it; a barrier left waiting is broken below
        sync[0].abort()
        sync[1].abort()
        out.put(("error", f"client process {k}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_processes(cfg: BenchServeConfig, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    """The run of ``reqs`` from ``cfg.client_processes`` processes (see the module docstring): the same
    result as ``bench_serve._benchmark`` gives for one.

    Raises:
        ConfigurationError: the server failed the probe request, or a client process failed (its error and
            traceback in the message).
    """
    model, version, kind = run_loop(discover(cfg))
    n = cfg.client_processes
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    start_wall = ctx.Value("d", 0.0)
    out = ctx.Queue()
    sync = (ready, go, start_wall)
    procs = [
        ctx.Process(target=_worker, args=(cfg, reqs, k, model, kind, cap, sync, out), daemon=True)
        for k, cap in enumerate(shares(cfg.max_concurrency, n))
    ]
    for p in procs:
        p.start()
    try:
        try:
            ready.wait(_SETUP_TIMEOUT_S)
            start_wall.value = time.time() + 0.05
            go.wait(_SETUP_TIMEOUT_S)
        except Exception:  # a process failed or never came: its own error is in the queue
            pass
        results: list[Any] = [None] * len(reqs)
        end = 0.0
        for status, value in collect(procs, out, cfg.request_timeout_s + _SETUP_TIMEOUT_S):
            if status != "ok":
                raise bad_config("--client-processes", "client processes that finish", value)
            indices, part, t = value
            for i, r in zip(indices, part, strict=True):
                results[i] = r
            end = max(end, t)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return report(results, end - start_wall.value, cfg, model, version, kind)


def collect(procs: list[Any], out: Any, limit_s: float, poll_s: float = _POLL_S) -> Iterator[Any]:
    """Yield one report per process of ``procs`` from the queue ``out``, in arrival order (the caller can stop
    at a failed one). Every ``poll_s`` seconds without a report it looks at the processes' exit codes, so a
    process that died without reporting (killed, out of memory) fails the run within seconds instead of after
    ``limit_s``.

    Raises:
        ConfigurationError: a process ended without a report (the exit codes in the message), or no report for
            ``limit_s`` seconds.
    """
    got = 0
    deadline = time.monotonic() + limit_s
    while got < len(procs):
        try:
            item = out.get(timeout=poll_s)
        except queue.Empty:
            ended = [p.exitcode for p in procs if p.exitcode is not None]
            if len(ended) <= got:  # every process still running has yet to report
                if time.monotonic() > deadline:
                    raise bad_config(
                        "--client-processes", "every client process to report", f"none for {limit_s:.0f} s"
                    ) from None
                continue
            try:  # a report put just before its process exited is in the pipe by now
                item = out.get(timeout=poll_s)
            except queue.Empty:
                raise bad_config(
                    "--client-processes",
                    "every client process to report",
                    f"{len(ended) - got} that ended without a report (exit codes {sorted(ended)})",
                    "A client process was killed or crashed: see its output above.",
                ) from None
        got += 1
        yield item
