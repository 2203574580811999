"""The engine core's own process (vLLM V1's ``EngineCoreProc``): :func:`run_engine_core` is the process's
main; :class:`EngineCoreProc` its busy loop.

The loop drains every message waiting on the input socket (requests, aborts, utility calls, shutdown), then
runs one step while the core has work and sends that step's :class:`EngineCoreOutputs` as one message. With
no work it polls the input socket, busy, for ``idle_poll_s`` seconds after its last step (a request that
comes then meets an awake CPU: see ``LLM``'s ``idle_poll_s``), then blocks on it (and on the parent's
sentinel: a parent that died takes the core with it). New requests therefore join the running batch at the
next step. Messages are msgpack (:mod:`.serial`); SIGINT is ignored (the front end decides when to stop),
SIGTERM exits cleanly.
"""

from __future__ import annotations

import gc
import importlib
import logging
import multiprocessing
import os
import signal
import time
import traceback
from typing import Any

from ..config import resolve_idle_poll_s
from . import serial
from .messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from .serial import AbortRequests, CoreFailed, CoreReady, Shutdown, UtilityCall, UtilityResult

__all__ = ["UTILITY_METHODS", "EngineCoreProc", "run_engine_core"]

log = logging.getLogger("layerzero.engine")

UTILITY_METHODS = frozenset(
    {"get_stats", "kernel_report", "reset_prefix_cache", "dispatch_counters", "enable_dispatch_counters"}
)
"""The core's methods a :class:`UtilityCall` may run (anything else is refused with a typed error)."""

DEFAULT_CORE = "layerzero.engine.core.engine_core:EngineCore"
"""The core class :func:`run_engine_core` builds unless told another (``module:attribute``)."""


def _load(path: str) -> Any:
    """The attribute ``module:attribute`` names (imported in this process)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class _Stop(Exception):
    """Leave the busy loop (a Shutdown message, SIGTERM, the parent gone)."""


class EngineCoreProc:
    """Runs ``core`` (an :class:`~.messages.EngineCoreProtocol`) behind connected zmq sockets: ``input``
    (PULL: messages from the front end) and ``output`` (PUSH: messages to it), or one of each per front-end
    process when several share the core (``layerzero serve --api-server-count``): lists of sockets, where
    client ``k`` sends on ``input[k]`` and receives on ``output[k]``. Each request's outputs, a utility
    call's result and a failed request's error go to the client that sent it; a step's stats and
    :class:`CoreFailed` go to every client."""

    def __init__(
        self,
        core: Any,
        input_socket: Any,
        output_socket: Any,
        parent_sentinel: int | None,
        idle_poll_s: float = 0.0,
        clock: Any = time.monotonic,
    ) -> None:
        import zmq

        self.core = core
        self.inputs = list(input_socket) if isinstance(input_socket, list | tuple) else [input_socket]
        self.outputs = list(output_socket) if isinstance(output_socket, list | tuple) else [output_socket]
        if len(self.inputs) != len(self.outputs):
            raise ValueError(f"engine core: {len(self.inputs)} input sockets but {len(self.outputs)} outputs")
        self.input, self.output = self.inputs[0], self.outputs[0]
        self._zmq = zmq
        self.poller = zmq.Poller()
        for sock in self.inputs:
            self.poller.register(sock, zmq.POLLIN)
        self.parent_sentinel = parent_sentinel
        if parent_sentinel is not None:
            self.poller.register(parent_sentinel, zmq.POLLIN)
        self._stats = getattr(core, "get_stats", None)
        self.idle_poll_s, self.clock = float(idle_poll_s), clock
        self.last_step = clock()
        #: several clients: request id -> [client index, completions not finished yet]
        self._routes: dict[str, list[int]] = {}

    def send(self, msg: Any, client: int | None = None) -> None:
        """Send ``msg`` to ``client`` (None: every client; a step's outputs: each its own)."""
        if client is None and len(self.outputs) > 1 and isinstance(msg, EngineCoreOutputs) and msg.outputs:
            self._send_split(msg)
            return
        data = serial.encode(msg)  # copied: zero-copy sends cost more below ~64 KiB (pyzmq)
        for sock in self.outputs if client is None else (self.outputs[client],):
            sock.send(data)

    def _send_split(self, msg: EngineCoreOutputs) -> None:
        parts: list[list[EngineCoreOutput]] = [[] for _ in self.outputs]
        for o in msg.outputs:
            route = self._routes.get(o.request_id)
            if route is None:
                log.error("engine core: an output of request %r, which no client sent; dropped", o.request_id)
                continue
            parts[route[0]].append(o)
            if o.finish_reason is not None:
                route[1] -= 1
                if route[1] <= 0:
                    del self._routes[o.request_id]
        for sock, outs in zip(self.outputs, parts, strict=True):
            sock.send(serial.encode(EngineCoreOutputs(outs, msg.timestamp, msg.stats)))

    def run(self) -> None:
        """The busy loop; returns on Shutdown, SIGTERM or the parent's death. A step that raises sends
        :class:`CoreFailed` and re-raises (the process then exits non-zero)."""
        core = self.core
        try:
            while True:
                busy = core.has_unfinished_requests()
                handled = self._drain(block=False) if busy else self._wait_idle()
                if core.has_unfinished_requests():
                    try:
                        outs = core.step()
                    except Exception as exc:
                        self.send(CoreFailed(type(exc).__name__, str(exc), "step", traceback.format_exc()))
                        raise
                    self.last_step = self.clock()
                    if outs.stats is None and self._stats is not None:
                        outs.stats = self._stats()
                    self.send(outs)
                elif handled and self._stats is not None:  # gone idle: the front end's stats catch up
                    self.send(EngineCoreOutputs([], time.monotonic(), self._stats()))
        except _Stop:
            return

    def _wait_idle(self) -> bool:
        """Wait for messages with no work: poll without blocking until one comes or ``idle_poll_s`` seconds
        have passed since the last step, then block; whether any was handled."""
        end = self.last_step + self.idle_poll_s
        while self.clock() < end:
            if self._drain(block=False):
                return True
        return self._drain(block=True)

    def _drain(self, block: bool) -> bool:
        """Handle every message waiting (waiting for the first one when ``block``); whether any was."""
        zmq = self._zmq
        events = dict(self.poller.poll(None if block else 0))
        if self.parent_sentinel is not None and self.parent_sentinel in events:
            log.warning("engine core: the front-end process is gone; exiting")
            raise _Stop
        handled = False
        for client, sock in enumerate(self.inputs):
            if sock not in events:
                continue
            handled = True
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(data, client)
        return handled

    def _handle(self, data: bytes, client: int = 0) -> None:
        try:
            msg = serial.decode(data)
        except serial.MessageError as exc:
            if exc.request_id is None:
                log.error("engine core: dropped a message it cannot decode: %s", exc)
                return
            self._fail_request(exc.request_id, str(exc), client=client)
            return
        if isinstance(msg, EngineCoreRequest):
            n = msg.sampling_params.n
            if len(self.outputs) > 1:
                self._routes[msg.request_id] = [client, n]
            try:
                self.core.add_request(msg)
            except Exception as exc:  # a duplicate id, a request the core cannot take: fail it, not the core
                self._fail_request(msg.request_id, f"{type(exc).__name__}: {exc}", n, client)
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.aborts)
        elif isinstance(msg, UtilityCall):
            self.outputs[client].send(self._utility(msg))
        elif isinstance(msg, Shutdown):
            raise _Stop
        else:
            log.error("engine core: dropped a message of type %s", type(msg).__name__)

    def _fail_request(self, request_id: str, why: str, n: int = 1, client: int = 0) -> None:
        outs = [EngineCoreOutput(request_id, i, [], finish_reason="error", error=why) for i in range(n)]
        self._routes.pop(request_id, None)  # the error goes to its sender, and nothing after it
        self.send(EngineCoreOutputs(outs, time.monotonic(), None), client)

    def _utility(self, call: UtilityCall) -> bytes:
        """The encoded :class:`UtilityResult` of ``call``: its value, or the error it raised (a method off
        the allow-list, a value that is not plain data, any exception of the method)."""
        if call.method not in UTILITY_METHODS:
            return serial.encode(
                UtilityResult(
                    call.call_id,
                    error_type="InvalidInputError",
                    error=f"utility method: expected one of {sorted(UTILITY_METHODS)}, got {call.method!r}",
                )
            )
        try:
            return serial.encode(UtilityResult(call.call_id, getattr(self.core, call.method)(*call.args)))
        except Exception as exc:
            return serial.encode(UtilityResult(call.call_id, error_type=type(exc).__name__, error=str(exc)))


def _device_type(core: Any) -> str | None:
    """The type of the device ``core`` runs on (``"cuda"``, ``"cpu"``; None for a core without one)."""
    return getattr(getattr(core, "device", None), "type", None)


def _freeze_gc(config: Any, core: Any) -> None:
    """``freeze_gc`` (see ``LLM``) for the core process: everything alive once the core is built moves to the
    permanent generation (None: on for CUDA devices)."""
    on = config.freeze_gc if config.freeze_gc is not None else _device_type(core) == "cuda"
    if on:
        gc.collect()
        gc.freeze()


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_engine_core(
    config: bytes,
    input_address: str | list[str],
    output_address: str | list[str],
    core_factory: str | None,
    visible_devices: str | None = None,
) -> None:
    """The engine core process's main: connect to the front end's sockets, build the core from ``config``
    (:func:`serial.encode_config`'s bytes) with ``core_factory`` (``module:attribute``; None:
    :data:`DEFAULT_CORE`), report :class:`CoreReady` (or :class:`CoreFailed` and exit 1), run the busy loop,
    then shut the core down and exit 0 (1 when a step raised). ``visible_devices``: set as
    ``CUDA_VISIBLE_DEVICES`` before anything touches CUDA (a data-parallel replica's GPUs). Lists of
    addresses (one input and one output per client, in the same order): several front-end processes share
    this core, and each gets the handshake."""
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _sigterm)
    import zmq

    ins = [input_address] if isinstance(input_address, str) else list(input_address)
    outs = [output_address] if isinstance(output_address, str) else list(output_address)
    ctx = zmq.Context()
    inp = [ctx.socket(zmq.PULL) for _ in ins]
    out = [ctx.socket(zmq.PUSH) for _ in outs]
    for s in inp + out:
        s.setsockopt(zmq.LINGER, 2000)  # the last messages (outputs, CoreFailed) still reach the front end
    for s, addr in zip(inp, ins, strict=True):
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(addr)
    for s, addr in zip(out, outs, strict=True):
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(addr)

    def to_all(msg: Any) -> None:
        data = serial.encode(msg)
        for s in out:
            s.send(data)

    parent = multiprocessing.parent_process()
    core, code = None, 0
    try:
        ec = serial.decode_config(config)
        core = _load(core_factory or DEFAULT_CORE)(ec)
        _freeze_gc(ec, core)
        info = {
            "max_model_len": getattr(core, "max_model_len", None),
            "num_kv_blocks": getattr(core, "num_kv_blocks", None),
            "pid": os.getpid(),
        }
        to_all(CoreReady(info))
        idle = resolve_idle_poll_s(ec, _device_type(core))
        EngineCoreProc(core, inp, out, parent.sentinel if parent is not None else None, idle).run()
    except SystemExit:
        pass
    except Exception as exc:
        if core is None:  # start-up failed: the front end raises it
            to_all(CoreFailed(type(exc).__name__, str(exc), "startup", traceback.format_exc()))
            if len(out) > 1:  # shared: the launcher may stop the API servers before they print it
                log.error("engine core failed to start: %s: %s", type(exc).__name__, exc)
        else:
            log.exception("engine core failed")
        code = 1
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                log.exception("engine core: shutdown raised")
        for s in inp + out:
            s.close()
        ctx.term()
    if code:
        raise SystemExit(code)
