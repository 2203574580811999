"""``layerzero serve --api-server-count K`` (vLLM's option; default: ``--data-parallel-size``): ``K``
API-server processes on one listening socket in front of shared engine cores.

One API-server process (HTTP, tokenization, detokenization, SSE) streams some tens of thousands of tokens a
second before its one core is full: measured on an H200 host, two data-parallel replicas behind one process
reached 1.5x one replica with the process at 94-100% of a core. So the launcher (:func:`run_api_servers`,
the ``layerzero serve`` process) starts the engine cores itself (:class:`~..core.shared_cores.SharedCores`:
one per data-parallel replica, each with a pair of sockets per API server), opens the listening socket, and
spawns ``K`` API servers that share it (the kernel hands each new connection to one of them); each attaches
to every core and routes its requests over all replicas with its own ``DPRouter`` (load and prefix
affinity as it sees them: its own requests).

- ``/metrics`` aggregates over the API servers: the launcher sets ``PROMETHEUS_MULTIPROC_DIR`` (a temporary
  directory) for them, so the front-end counters and histograms are prometheus-client's multiprocess
  values; the engine's gauges come from the cores' stats, which every API server receives.
- Signals: the API servers run in their own process group; the launcher forwards its first SIGINT / SIGTERM
  to each as SIGTERM (each drains, as one server does), waits for them, then stops the cores. A second
  signal kills them.
- Faults: an API server or a core that exits on its own takes the whole server down (the others get SIGTERM,
  the cores are stopped) and ``layerzero serve`` exits 1, never leaving a child behind; an API server whose
  launcher died drains and exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["run_api_servers"]

log = logging.getLogger("layerzero.engine.server")

_STOP_TIMEOUT_S = 10.0  # beyond the drain timeout: how long an API server may take to exit after SIGTERM


def _listen(host: str, port: int) -> socket.socket:
    """The listening TCP socket every API server accepts on (SO_REUSEADDR, as uvicorn binds).

    Raises:
        ConfigurationError: the address cannot be bound (in use, not this machine's)."""
    import layerzero as lz

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise lz.ConfigurationError(
            f"--host / --port: expected an address this machine can listen on, got {host}:{port} ({exc}). "
            "Pick another --port, or stop the process that holds it."
        ) from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_api_servers(
    args: Any,
    engine_options: dict[str, Any],
    count: int,
    replicas: list[tuple[Any, str | None]],
    worker: Callable[..., None],
    http_stack: str = "",
) -> int:
    """``layerzero serve`` with ``count`` API servers (see the module docstring) over the cores of
    ``replicas`` (``(engine config, visible devices)`` per data-parallel replica); ``worker`` is each API
    server's main (``api_server.run_api_worker``: called as ``worker(index, args, engine_options,
    endpoints, sock)`` in a spawned process); ``http_stack`` names uvicorn's loop and parser for the log.
    Returns the exit code (0: stopped by a signal after draining; 1: a child failed).

    Raises:
        ConfigurationError: the address cannot be bound; as :class:`SharedCores`.
    """
    from ...core.shared_cores import SharedCores

    sock = _listen(args.host, args.port)  # first: a busy port fails before anything starts
    prom = tempfile.mkdtemp(prefix="layerzero-prometheus-")
    old_prom = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom  # inherited by the spawned API servers
    cores: SharedCores | None = None
    workers: list[Any] = []
    stopping = threading.Event()
    code = 0

    def stop_all(signum: int | None = None, frame: Any = None) -> None:
        if signum is not None and stopping.is_set():  # a second signal: no more draining
            for w in workers:
                if w.is_alive():
                    w.kill()
            return
        stopping.set()
        for w in workers:
            if w.is_alive():
                os.kill(w.pid, signal.SIGTERM)

    old = {s: signal.signal(s, stop_all) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cores = SharedCores(replicas, count, engine_options.get("_core_factory"))
        options = {k: v for k, v in engine_options.items() if k != "_core_factory"}  # the cores have it
        spawn = multiprocessing.get_context("spawn")
        for k in range(count):
            w = spawn.Process(
                target=worker,
                args=(k, args, options, cores.endpoints(k), sock),
                name=f"LayerZeroAPIServer-{k}",
            )
            w.start()
            workers.append(w)
        log.info(
            "serving %s on http://%s:%d: %d API servers, %d engine cores (%s)",
            args.model, args.host, args.port, count, len(replicas), http_stack,
        )  # fmt: skip
        code = _supervise(workers, cores, stopping, stop_all)
    finally:
        sock.close()
        stop_all()
        for w in workers:
            w.join(float(args.drain_timeout) + _STOP_TIMEOUT_S)
            if w.is_alive():
                log.warning("API server %s did not exit after SIGTERM; killing it", w.pid)
                w.kill()
                w.join()
        if cores is not None:
            cores.shutdown()
        for s, h in old.items():
            signal.signal(s, h)
        if old_prom is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = old_prom
        shutil.rmtree(prom, ignore_errors=True)
    return code


def _supervise(workers: list[Any], cores: Any, stopping: threading.Event, stop_all: Any) -> int:
    """Wait until every API server has exited; a child that exits before the server is stopping (a crash,
    a failed start-up) stops the rest. The exit code: 0, or 1 when a child failed."""
    code = 0
    live = {w.sentinel: w for w in workers}
    core_sentinels = set(cores.sentinels)
    while live:
        ready = multiprocessing.connection.wait([*live, *core_sentinels], timeout=1.0)
        for s in ready:
            if s in core_sentinels:
                core_sentinels.discard(s)
                if not stopping.is_set():
                    log.error("an engine core exited on its own: stopping the server")
                    code = 1
                    stop_all()
                continue
            w = live.pop(s)
            w.join()
            if not stopping.is_set() or w.exitcode not in (0, -signal.SIGTERM):
                log.error("API server %s exited with %s: stopping the server", w.name, w.exitcode)
                code = 1
                stop_all()
    return code
