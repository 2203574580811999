"""The front end's side of the engine core process (vLLM V1's ``MPClient``): start it, talk to it, notice its
death, stop it.

:class:`MPClient` spawns :func:`~.core_proc.run_engine_core` (``spawn`` context: the child inherits no
sockets or locks; it gets the :class:`EngineConfig` as msgpack bytes) and binds two zmq sockets on ``ipc://``
paths in a private temporary directory (``tcp://127.0.0.1`` where zmq has no IPC): PUSH for requests, aborts
and utility calls, PULL for the core's messages. The handshake waits for the core's :class:`CoreReady`
(``max_model_len``, ``num_kv_blocks``) or its start-up error, raised here as a typed error.

Once bound to an asyncio loop (:meth:`MPClient.bind`), the output socket and the process's sentinel are
watched by the loop's reader callbacks: every :class:`EngineCoreOutputs` goes to ``on_outputs`` (one message
per step, all its requests at once), utility results resolve their futures, and the core's death (a crash, a
kill, a failed step) calls ``on_dead`` with an :class:`EngineDeadError` exactly once. Sends never block: the
socket's queue is unbounded and a dead core is refused before sending.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.util
import os
import select
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import layerzero as lz

from ..errors import bad_input
from . import serial
from .core_proc import UTILITY_METHODS, run_engine_core
from .errors import EngineCoreError, EngineDeadError
from .messages import EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest
from .serial import AbortRequests, CoreFailed, CoreReady, Shutdown, UtilityCall, UtilityResult

__all__ = ["STARTUP_TIMEOUT_S", "MPClient", "RemoteProcess"]

log = logging.getLogger("layerzero.engine")

STARTUP_TIMEOUT_S = 1800.0
"""How long :class:`MPClient` waits for the core's handshake (loading weights, warming up) before it gives
up, stops the process and raises."""

STOP_TIMEOUT_S = 10.0
"""How long :meth:`MPClient.shutdown` waits for the core to exit after each of Shutdown, SIGTERM, SIGKILL."""

_REMOTE_ERRORS: dict[str, type[Exception]] = {
    "ConfigurationError": lz.ConfigurationError,
    "InvalidInputError": lz.InvalidInputError,
}
"""Errors of the core process that the front end raises as the same type (their messages already say what
failed and how to fix it); any other becomes an :class:`EngineCoreError`."""

_DRAIN_MAX = 64  # messages handled per wake-up of the output reader before yielding to the loop


def remote_error(error_type: str, message: str, what: str) -> Exception:
    """The front end's exception for an error of type ``error_type`` raised in the core."""
    cls = _REMOTE_ERRORS.get(error_type)
    if cls is not None:
        return cls(message)
    return EngineCoreError(f"{what}: {error_type}: {message}", remote_type=error_type)


class MPClient:
    """Starts the engine core process for ``config`` (an :class:`~layerzero.engine.EngineConfig`);
    :meth:`wait_ready` waits for its handshake. ``core_factory``: ``module:attribute`` of the core class the
    child builds (None: the real :class:`EngineCore`; tests pass a fake). ``visible_devices``: the child's
    ``CUDA_VISIBLE_DEVICES`` (a data-parallel replica's GPUs; None: inherited). ``info``: the handshake
    (``max_model_len``, ``num_kv_blocks``, ``pid``). ``attach``: ``{"input", "output", "pid"}`` of a core
    another process started for several front ends (``layerzero serve --api-server-count``,
    :mod:`~layerzero.engine.core.shared_cores`): the client binds those two addresses, watches the process
    through a :class:`RemoteProcess`, and its :meth:`shutdown` leaves the core running (its owner stops it).

    Raises:
        ConfigurationError: the core rejected the options (as ``LLM`` would).
        EngineCoreError: the core failed to start for another reason, exited before its handshake, or did not
            finish it within ``startup_timeout`` seconds (the process is then stopped).
    """

    def __init__(
        self,
        config: Any,
        *,
        core_factory: str | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        on_outputs: Callable[[EngineCoreOutputs], None] | None = None,
        on_dead: Callable[[EngineDeadError], None] | None = None,
        visible_devices: str | None = None,
        name: str = "LayerZeroEngineCore",
        attach: dict[str, Any] | None = None,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self.dead_error: EngineDeadError | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._output = self._ctx.socket(zmq.PULL)
        for s in (self._input, self._output):
            s.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._output.setsockopt(zmq.RCVHWM, 0)
        if attach is not None:  # a core another process started and stops: bind where it connects
            self._tmp = None
            self._input.bind(attach["input"])
            self._output.bind(attach["output"])
            self.proc: Any = RemoteProcess(int(attach["pid"]))
        else:
            self._tmp = tempfile.mkdtemp(prefix="layerzero-engine-")
            addrs = [self._bind(s, name) for s, name in ((self._input, "input"), (self._output, "output"))]
            spawn = multiprocessing.get_context("spawn")
            self.proc = spawn.Process(
                target=run_engine_core,
                args=(serial.encode_config(config), addrs[0], addrs[1], core_factory, visible_devices),
                name=name,
            )
        # before the interpreter joins its children at exit (multiprocessing's own exit hook runs the
        # finalizers with an exit priority first), and when the client is collected: stop the child
        self._finalizer = multiprocessing.util.Finalize(
            self,
            _cleanup,
            args=(self.proc, self._ctx, (self._input, self._output), self._tmp),
            exitpriority=100,
        )
        if attach is None:
            self.proc.start()
        self.info: dict[str, Any] = {}
        self._startup_timeout = startup_timeout

    def wait_ready(self) -> dict[str, Any]:
        """Wait for the core's handshake (the caller may do other work between starting the client and
        this); returns :attr:`info`. Raises: as the class says (the process is then stopped)."""
        if not self.info:
            self.info = self._handshake(self._startup_timeout)
        return self.info

    def _bind(self, sock: Any, name: str) -> str:
        if self._zmq.has("ipc") and self._tmp is not None:
            addr = f"ipc://{os.path.join(self._tmp, name)}"
            sock.bind(addr)
            return addr
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        return f"tcp://127.0.0.1:{port}"

    def _handshake(self, timeout: float) -> dict[str, Any]:
        poller = self._zmq.Poller()
        poller.register(self._output, self._zmq.POLLIN)
        waited = 0.0
        while True:
            if poller.poll(100):
                msg = serial.decode(self._output.recv())
                if isinstance(msg, CoreReady):
                    return msg.info
                self.shutdown()
                if isinstance(msg, CoreFailed):
                    raise remote_error(msg.error_type, msg.message, "engine core failed to start")
                raise EngineCoreError(f"engine core handshake: expected CoreReady, got {type(msg).__name__}")
            waited += 0.1
            if not self.proc.is_alive():
                code = self.proc.exitcode
                self.shutdown()
                raise EngineCoreError(
                    f"engine core process: expected a handshake, got exit code {code} before it. A script "
                    "that starts an engine at import time needs `if __name__ == '__main__':` (the core "
                    "process is spawned and imports the main module); its stderr says more."
                )
            if waited > timeout:
                self.shutdown()
                raise EngineCoreError(
                    f"engine core handshake: expected within {timeout:.0f} s, got nothing",
                    remote_type=None,
                )

    # --------------------------------------------------------------------------------------- the loop side
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the output socket and the process from ``loop`` (the running loop of the caller; called by
        every async entry point). A client may move to a new loop once its previous one is closed or
        stopped (e.g. successive ``asyncio.run`` calls).

        Raises:
            EngineDeadError: the core is gone. RuntimeError: the previous loop still runs.
        """
        self.check_alive()
        if loop is self._loop:
            return
        old = self._loop
        if old is not None:
            if old.is_running():
                raise RuntimeError("MPClient is bound to another running event loop; use one loop per engine")
            if not old.is_closed():
                self._unwatch(old)
            for fut in self._calls.values():
                fut.cancel()
            self._calls.clear()
        self._loop = loop
        loop.add_reader(self._output.getsockopt(self._zmq.FD), self._on_readable)
        loop.add_reader(self.proc.sentinel, self._on_sentinel)
        loop.call_soon(self._on_readable)  # messages that arrived before the reader was registered

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        for fd in (self._output.getsockopt(self._zmq.FD), self.proc.sentinel):
            try:
                loop.remove_reader(fd)
            except (ValueError, OSError, RuntimeError):  # closed fd or loop
                pass

    def _on_readable(self) -> None:
        """Handle the messages waiting on the output socket (zmq's FD is edge-triggered: drain it)."""
        zmq = self._zmq
        if self._closed:
            return
        try:
            for _ in range(_DRAIN_MAX):
                if not self._output.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                self._handle(serial.decode(self._output.recv(zmq.NOBLOCK)))
                if self._closed or self.dead_error is not None:
                    return
            if self._loop is not None:
                self._loop.call_soon(self._on_readable)  # more waiting: yield to the loop, then go on
        except Exception as exc:  # a bug in output handling must not leave streams waiting forever
            log.exception("engine front end: handling the core's output failed")
            self._mark_dead(EngineDeadError(f"handling the engine core's output failed: {exc!r}"))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, EngineCoreOutputs):
            if self.on_outputs is not None:
                self.on_outputs(msg)
        elif isinstance(msg, UtilityResult):
            fut = self._calls.pop(msg.call_id, None)
            if fut is None and msg.error_type is not None:  # a call nobody waits for failed
                log.warning("engine core utility call failed: %s: %s", msg.error_type, msg.error)
            if fut is not None and not fut.done():
                if msg.error_type is None:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception(
                        remote_error(msg.error_type, msg.error or "", "engine core utility call")
                    )
        elif isinstance(msg, CoreFailed):
            why = f"engine core failed in a {msg.during}: {msg.error_type}: {msg.message}"
            self._mark_dead(EngineDeadError(why))
        else:
            log.error("engine front end: dropped a message of type %s", type(msg).__name__)

    def _on_sentinel(self) -> None:
        if self._loop is not None:
            self._unwatch(self._loop)
        if self.dead_error is None and not self._closed:
            self._on_readable()  # the core's last words (CoreFailed, final outputs) first
            self._mark_dead(self._death())

    def _death(self) -> EngineDeadError:
        self.proc.join(1.0)
        return EngineDeadError(
            f"engine core process {self.proc.pid} died (exit code {self.proc.exitcode}); "
            "in-flight requests are lost. Start a new engine."
        )

    def _mark_dead(self, error: EngineDeadError, *, quiet: bool = False) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        if not quiet:
            log.error("%s", error)
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(error)
        if self.on_dead is not None:
            self.on_dead(error)

    # --------------------------------------------------------------------------------------------- calls
    @property
    def errored(self) -> bool:
        """Whether the core is gone (died or failed) other than by :meth:`shutdown`."""
        if self.dead_error is None and not self._closed and not self.proc.is_alive():
            self._mark_dead(self._death())
        return self.dead_error is not None and not self._closed

    def check_alive(self) -> None:
        """Raises: EngineDeadError: the core died, failed or was shut down."""
        if self._closed:
            raise self.dead_error or EngineDeadError("the engine was shut down")
        if self.errored:
            raise self.dead_error  # type: ignore[misc]

    def _send(self, msg: Any) -> None:
        self.check_alive()
        try:
            self._input.send(serial.encode(msg), self._zmq.NOBLOCK)  # copied: cheaper for small messages
        except self._zmq.Again as exc:  # no peer any more: the core is gone
            self._mark_dead(self._death())
            raise self.dead_error from exc  # type: ignore[misc]

    def add_request(self, request: EngineCoreRequest) -> None:
        """Send ``request`` to the core (it joins the batch at the core's next step).

        Raises:
            EngineDeadError: the core is gone."""
        self._send(request)

    def abort_requests(self, aborts: list[EngineCoreAbort]) -> None:
        """Send ``aborts`` to the core (one message). Raises: EngineDeadError: the core is gone."""
        if aborts:
            self._send(AbortRequests(list(aborts)))

    async def call_utility(self, method: str, *args: Any) -> Any:
        """``method(*args)`` run by the core between two steps; its plain-data result.

        Raises:
            InvalidInputError: ``method`` is not in :data:`~.core_proc.UTILITY_METHODS`. EngineDeadError: the
                core is gone (before or while waiting). EngineCoreError: the method raised in the core.
        """
        if method not in UTILITY_METHODS:
            raise bad_input("engine core utility method", f"one of {sorted(UTILITY_METHODS)}", repr(method))
        loop = asyncio.get_running_loop()
        self.bind(loop)
        call_id = next(self._call_ids)
        fut = loop.create_future()
        self._calls[call_id] = fut
        try:
            self._send(UtilityCall(call_id, method, list(args)))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def call_utility_nowait(self, method: str, *args: Any) -> None:
        """Send ``method(*args)`` to the core without waiting for its result (no event loop needed); the core
        runs it before any message sent after it. A failure is logged.

        Raises:
            InvalidInputError: ``method`` is not in :data:`~.core_proc.UTILITY_METHODS`. EngineDeadError: the
                core is gone.
        """
        if method not in UTILITY_METHODS:
            raise bad_input("engine core utility method", f"one of {sorted(UTILITY_METHODS)}", repr(method))
        self._send(UtilityCall(next(self._call_ids), method, list(args)))

    def shutdown(self) -> None:
        """Stop the core (a Shutdown message, then SIGTERM, then SIGKILL, :data:`STOP_TIMEOUT_S` apart at
        most), close the sockets, delete the temporary directory. Idempotent; also runs when the client is
        collected and at interpreter exit. Pending utility calls raise :class:`EngineDeadError`."""
        if self._closed:
            return
        if self.dead_error is None:
            self._mark_dead(EngineDeadError("the engine was shut down"), quiet=True)
        self._closed = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            self._unwatch(loop)
        self._finalizer()


def _cleanup(
    proc: Any, ctx: Any, sockets: tuple[Any, ...], tmp: str | None, timeout: float = STOP_TIMEOUT_S
) -> None:
    """Stop ``proc`` (unless another process owns it: a :class:`RemoteProcess`) and free the sockets and the
    directory (holds no reference to the client)."""
    import zmq

    if isinstance(proc, RemoteProcess):
        proc.close()
    else:
        try:
            if proc.is_alive():
                try:
                    sockets[0].send(serial.encode(Shutdown()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        except (AssertionError, ValueError):  # the process was never started
            pass
    for s in sockets:
        s.close(linger=0)
    ctx.term()
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


class RemoteProcess:
    """An engine core this process did not start (``layerzero serve --api-server-count``: the launcher owns
    it), with the part of ``multiprocessing.Process`` the client uses: ``pid``, ``sentinel`` (a pidfd,
    readable once the process has exited; Linux 5.3+), :meth:`is_alive`, :meth:`join`, ``exitcode`` (None:
    only the parent can read it).

    Raises:
        ConfigurationError: no ``os.pidfd_open`` (not Linux), or no process ``pid``.
    """

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        if not hasattr(os, "pidfd_open"):
            raise lz.ConfigurationError(
                "api-server-count: expected Linux (os.pidfd_open) to watch a shared engine core, got "
                f"{os.name}. Use one API server (--api-server-count 1)."
            )
        try:
            self.sentinel = os.pidfd_open(pid)
        except OSError as exc:
            raise lz.ConfigurationError(f"engine core: expected a running process {pid}, got {exc}") from exc

    def join(self, timeout: float | None = None) -> None:
        if self.sentinel >= 0:
            select.select([self.sentinel], [], [], timeout)

    def is_alive(self) -> bool:
        return self.sentinel >= 0 and not select.select([self.sentinel], [], [], 0)[0]

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1
