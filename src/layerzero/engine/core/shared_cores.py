"""Engine cores shared by several front-end processes (``layerzero serve --api-server-count K``, vLLM's
option of the same name): :class:`SharedCores` starts one core process per data-parallel replica, each with
``K`` pairs of zmq sockets, one per API-server process; API server ``k`` attaches to every core through
:meth:`SharedCores.endpoints` (``AsyncLLM(..., _attach=...)``, ``MPClient(attach=...)``), so each of them
routes its own requests over all replicas. The launcher owns the cores: it stops them after the API servers
are gone (SIGTERM, then SIGKILL); a core also exits when the launcher dies (it watches its parent).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
from typing import Any

import layerzero as lz

from . import serial
from .core_proc import run_engine_core

__all__ = ["SharedCores"]

log = logging.getLogger("layerzero.engine")


class SharedCores:
    """Start a core per ``(config, visible_devices)`` of ``replicas`` (``async_llm.replica_configs``) for
    ``num_clients`` front-end processes. ``core_factory``: as ``MPClient``'s (tests pass a fake core).

    Raises:
        ConfigurationError: ``num_clients < 1``, or zmq without IPC transport (not Linux / macOS).
    """

    def __init__(
        self, replicas: list[tuple[Any, str | None]], num_clients: int, core_factory: str | None = None
    ) -> None:
        import zmq

        if num_clients < 1:
            raise lz.ConfigurationError(f"api-server-count: expected an int >= 1, got {num_clients}")
        if not zmq.has("ipc"):
            raise lz.ConfigurationError(
                "api-server-count: expected zmq with IPC transport, got none. Use --api-server-count 1."
            )
        self.num_clients = num_clients
        self._tmp = tempfile.mkdtemp(prefix="layerzero-cores-")
        spawn = multiprocessing.get_context("spawn")
        #: per replica: (input addresses, output addresses), one of each per client
        self.addresses: list[tuple[list[str], list[str]]] = []
        self.procs: list[Any] = []
        try:
            for r, (config, devices) in enumerate(replicas):
                ins = [f"ipc://{os.path.join(self._tmp, f'r{r}-c{k}-in')}" for k in range(num_clients)]
                outs = [f"ipc://{os.path.join(self._tmp, f'r{r}-c{k}-out')}" for k in range(num_clients)]
                proc = spawn.Process(
                    target=run_engine_core,
                    args=(serial.encode_config(config), ins, outs, core_factory, devices),
                    name=f"LayerZeroEngineCore-DP{r}" if len(replicas) > 1 else "LayerZeroEngineCore",
                )
                proc.start()
                self.addresses.append((ins, outs))
                self.procs.append(proc)
        except BaseException:
            self.shutdown()
            raise

    def endpoints(self, client: int) -> list[dict[str, Any]]:
        """What API server ``client`` attaches to: per replica ``{"input", "output", "pid"}``."""
        return [
            {"input": ins[client], "output": outs[client], "pid": p.pid}
            for (ins, outs), p in zip(self.addresses, self.procs, strict=True)
        ]

    @property
    def sentinels(self) -> list[int]:
        """The core processes' sentinels (``multiprocessing.connection.wait``)."""
        return [p.sentinel for p in self.procs]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every core (SIGTERM: a clean exit; SIGKILL after ``timeout`` seconds) and delete the socket
        directory. Idempotent."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                log.warning("engine core %s did not stop in %.0f s after SIGTERM; killing it", p.pid, timeout)
                p.kill()
                p.join(timeout)
        shutil.rmtree(self._tmp, ignore_errors=True)
