"""The client side of an isolated backend: start the worker, send calls, turn failures into typed errors.

:class:`IsolatedBackend` owns one worker process (started lazily on the first call, under ``python``, with
``path`` prepended to its ``sys.path``) and one input arena (a shared-memory segment, grown by doubling). A
call checks every argument against the schema (:mod:`.protocol`) *before* anything is sent, copies the tensors
into the arena, sends a JSON header on the Unix socket, waits at most ``timeout_s`` for the reply and copies
the result tensors out of the worker's output arena. Nothing is pickled in either direction.

Failures: a schema violation -> ``InvalidInputError`` (nothing sent); the worker dies (EOF, broken pipe) ->
``IsolatedWorkerError`` naming its exit code and the tail of its stderr; no reply within ``timeout_s`` -> the
worker is killed and ``IsolatedWorkerTimeoutError`` raised; an exception inside the worker ->
``IsolatedWorkerError`` with the remote type, message and traceback text (the worker keeps serving). After a
death or a timeout the next call starts a fresh worker (``restart=True``, the default) or raises.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..core.errors import InvalidInputError, IsolatedWorkerError, IsolatedWorkerTimeoutError
from . import protocol as P

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
_LIVE: weakref.WeakSet[IsolatedBackend] = weakref.WeakSet()
"""Backends with a running worker, closed at interpreter exit (bookkeeping for shutdown only)."""
_ATEXIT = threading.Lock()
_atexit_registered = False


def _close_all() -> None:
    for backend in list(_LIVE):
        backend.close()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code} (killed by signal {-code})"
    return f"exit code {code}"


class IsolatedBackend:
    """One worker process serving ``"module:function"`` targets (see the module docstring).

    Args:
        python: the interpreter that runs the worker (default ``sys.executable``); it needs torch, not
            LayerZero.
        path: directories prepended to the worker's ``sys.path`` (where the target modules live).
        env: the worker's environment (default: this process's).
        timeout_s: longest wait for one call's reply; the worker is killed after it.
        start_timeout_s: longest wait for a new worker's ready message (imports torch).
        restart: start a fresh worker on the next call after a death or a timeout (else raise).
        name: shown in errors.

    Use as a context manager, or call :meth:`close`; live workers are also closed at interpreter exit.

    >>> with IsolatedBackend(path=["my_kernels"]) as b:  # doctest: +SKIP
    ...     y = b.call("mylib:rms_norm", x, w, 1e-6, None)
    """

    def __init__(
        self,
        *,
        python: str | os.PathLike[str] | None = None,
        path: Iterable[str | os.PathLike[str]] = (),
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
        restart: bool = True,
        name: str = "isolated",
    ) -> None:
        for what, v in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidInputError(
                    f"IsolatedBackend({what}): expected a number of seconds > 0, got {v!r}."
                )
        self.python = os.fspath(python) if python is not None else sys.executable
        self.path = [os.fspath(p) for p in path]
        self.env = dict(env) if env is not None else None
        self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
        self.restart, self.name = bool(restart), name
        self.starts = 0
        self.info: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._log: Any = None
        self._arena: P.Segment | None = None
        self._outs: dict[str, P.Segment] = {}
        self._dead: IsolatedWorkerError | None = None
        self._next_id = 0

    # -- lifecycle -------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def __enter__(self) -> IsolatedBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _stderr_tail(self, n: int = 2000) -> str:
        if self._log is None:
            return ""
        try:
            size = os.fstat(self._log.fileno()).st_size
            return os.pread(self._log.fileno(), n, max(0, size - n)).decode(errors="replace")
        except OSError:
            return ""

    def start(self) -> None:
        """Start the worker now (calls start it lazily). Raises IsolatedWorkerError when it cannot start."""
        global _atexit_registered
        with self._lock:
            if self._proc is not None:
                return
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._log = tempfile.TemporaryFile(prefix="lz-isolated-")
            cmd = [self.python, "-u", str(WORKER_SCRIPT), "--fd", str(child.fileno())]
            for p in self.path:
                cmd += ["--path", p]
            try:
                self._proc = subprocess.Popen(
                    cmd,
                    pass_fds=(child.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=self._log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                )
            except OSError as exc:
                parent.close()
                raise IsolatedWorkerError(
                    f"isolated backend {self.name!r}: cannot start {self.python!r}: {exc}"
                ) from None
            finally:
                child.close()
            self._sock = parent
            self.starts += 1
            with _ATEXIT:
                if not _atexit_registered:
                    atexit.register(_close_all)
                    _atexit_registered = True
            _LIVE.add(self)
            parent.settimeout(self.start_timeout_s)
            try:
                msg = P.recv(parent)
            except (TimeoutError, OSError, P.SchemaError, ValueError) as exc:
                msg, why = None, f"{type(exc).__name__}: {exc}"
            else:
                why = "no ready message"
            if msg is None or msg.get("op") != "ready":
                self._kill()
                code = self._proc.returncode if self._proc else None
                tail = self._stderr_tail()
                self._reset()
                raise IsolatedWorkerError(
                    f"isolated backend {self.name!r}: the worker under {self.python!r} did not start ({why}, "
                    f"{_exit_text(code)}). Its output ends with:\n{tail}",
                    exit_code=code,
                    stderr_tail=tail,
                )
            self.info = {k: msg.get(k) for k in ("pid", "python", "torch")}
            parent.settimeout(self.timeout_s)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _reset(self) -> None:
        """Forget the worker (after it died, timed out or was closed); the arenas go with it."""
        if self._sock is not None:
            self._sock.close()
        for seg in self._outs.values():
            seg.close()
        self._outs.clear()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self._log is not None:
            self._log.close()
        self._proc = self._sock = self._log = None
        _LIVE.discard(self)

    def close(self) -> None:
        """Ask the worker to exit (kill it after 5 s), free the shared memory. Idempotent."""
        with self._lock:
            if self._proc is None:
                return
            try:
                P.send(self._sock, {"op": "shutdown"})
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._kill()
            self._reset()

    def kill(self) -> None:
        """Kill the worker (tests, or a stuck kernel); the next call restarts it when ``restart`` is on."""
        with self._lock:
            self._kill()

    # -- calls -----------------------------------------------------------------------------------------------
    def _died(self, target: str, how: str) -> IsolatedWorkerError:
        self._kill()
        code = self._proc.returncode if self._proc is not None else None
        tail, pid = self._stderr_tail(), self.pid
        self._reset()
        err = IsolatedWorkerError(
            f"isolated backend {self.name!r}: the worker (pid {pid}) {how} during a call to {target!r}: "
            f"{_exit_text(code)}. "
            + ("The next call starts a new worker." if self.restart else "restart=False: later calls raise.")
            + (f" Its output ends with:\n{tail}" if tail.strip() else ""),
            exit_code=code,
            stderr_tail=tail,
        )
        if not self.restart:
            self._dead = err
        return err

    def call(self, target: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``target`` (``"module:function"``) in the worker with ``args``/``kwargs`` and return its
        result (new tensors, owned by this process).

        Raises:
            InvalidInputError: an argument outside the schema (objects, dicts, tensors on devices other than
                CPU and CUDA, tensors that require grad, ...); nothing was sent.
            IsolatedWorkerTimeoutError: no reply within ``timeout_s`` (the worker was killed).
            IsolatedWorkerError: the worker died or could not start, or the kernel raised inside it.
        """
        tensors: list[torch.Tensor] = []
        try:
            if not isinstance(target, str) or target.count(":") != 1:
                raise P.SchemaError(f"target: expected 'module:function', got {target!r}")
            P.collect(list(args), tensors, "args")
            for k, v in kwargs.items():
                P.collect(v, tensors, f"kwargs[{k!r}]")
        except P.SchemaError as exc:
            raise InvalidInputError(
                f"isolated call to {target!r}: {exc}. Only tensors (CPU, CUDA), None, bool, int, "
                "float, str and tuples/lists of those cross the process boundary."
            ) from None
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self.start()
            need = P.nbytes_needed(tensors)
            if need and (self._arena is None or self._arena.size < need):
                old = self._arena.size if self._arena is not None else 0
                if self._arena is not None:
                    self._arena.close()
                self._arena = P.Segment.create(max(need, 2 * old, 1 << 16), "lzc")
            place = (
                P.pack(self._arena.tensor, self._arena.name, tensors)
                if need
                else P.pack(torch.empty(0, dtype=torch.uint8), "", tensors)
            )
            self._next_id += 1
            msg = {
                "op": "call",
                "id": self._next_id,
                "target": target,
                "arena": self._arena.name if self._arena is not None else None,
                "args": [P.encode(a, place) for a in args],
                "kwargs": {k: P.encode(v, place) for k, v in kwargs.items()},
            }
            try:
                P.send(self._sock, msg)
                reply = P.recv(self._sock)
            except TimeoutError:
                pid = self.pid
                self._kill()
                self._reset()
                raise IsolatedWorkerTimeoutError(
                    f"isolated backend {self.name!r}: no reply from the worker (pid {pid}) within timeout_s="
                    f"{self.timeout_s} s for {target!r}; it was killed"
                    + ("; the next call starts a new one." if self.restart else ".")
                ) from None
            except OSError:
                raise self._died(target, "closed the connection") from None
            if reply is None:
                raise self._died(target, "exited")
            if reply.get("op") == "error":
                raise IsolatedWorkerError(
                    f"isolated kernel {target!r} raised in the worker: {reply.get('type')}: "
                    f"{reply.get('message')}\n--- remote traceback ---\n{reply.get('traceback')}",
                    remote_type=reply.get("type"),
                    remote_traceback=reply.get("traceback"),
                )
            if reply.get("op") != "result" or reply.get("id") != msg["id"]:
                raise self._died(target, f"sent an unexpected message {str(reply)[:100]!r}")
            try:
                return P.decode(reply["value"], self._tensor_out)
            except P.SchemaError as exc:
                raise self._died(target, f"sent a reply outside the schema ({exc})") from None

    def _tensor_out(self, d: dict[str, Any]) -> torch.Tensor:
        if "ipc" in d:  # the worker's CUDA result: cloned, so it never outlives the worker's allocation
            mapped = P.ipc_tensor(d)
            out = mapped.clone()
            if (
                mapped.numel()
            ):  # the copy must finish before the mapping is dropped (the worker may then reuse it)
                torch.cuda.current_stream(mapped.device).synchronize()
            return out
        seg = self._outs.get(d["shm"])
        if seg is None:
            for old in self._outs.values():
                old.close()
            self._outs = {d["shm"]: (seg := P.Segment.attach(d["shm"]))}
        return P.view(seg.tensor, d).clone()

    def kernel(self, target: str) -> Callable[..., Any]:
        """A plain callable forwarding to ``target`` in this worker (what ``register_isolated_kernel``
        registers)."""

        def isolated(*args: Any, **kwargs: Any) -> Any:
            return self.call(target, *args, **kwargs)

        isolated.__name__ = isolated.__qualname__ = f"isolated[{target}]"
        isolated.__doc__ = f"{target} in an isolated worker process ({self.python})"
        isolated.backend = self  # type: ignore[attr-defined]
        return isolated
