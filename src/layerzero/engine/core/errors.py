"""Errors of the engine core's process boundary (:mod:`.core_client`, :mod:`.core_proc`, :mod:`.serial`):
typed LayerZero errors that are also builtins, so callers that catch ``RuntimeError`` / ``ValueError`` keep
working."""

from __future__ import annotations

import layerzero as lz

__all__ = ["EngineCoreError", "EngineDeadError", "MessageError", "WorkerFailedError"]


class EngineDeadError(lz.LayerZeroError, RuntimeError):
    """The engine core process is gone (it died, failed inside a step, or the engine was shut down): every
    in-flight request's stream raises it, and so does every later call. Not recoverable: start a new engine
    (vLLM's ``EngineDeadError``)."""


class EngineCoreError(lz.LayerZeroError, RuntimeError):
    """The engine core reported an error the front end cannot map to a more precise type: a start-up failure
    of an unexpected kind, or a utility call that raised in the core. ``remote_type`` is the name of the
    exception's class in the core process."""

    def __init__(self, message: str, remote_type: str | None = None) -> None:
        super().__init__(message)
        self.remote_type = remote_type


class MessageError(lz.LayerZeroError, ValueError):
    """A message between the front end and the engine core that cannot be decoded: not msgpack, an unknown
    message type, fields of the wrong number or kind. ``request_id``: the request it concerns, when that much
    could be read (the core then fails that request instead of dropping it)."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class WorkerFailedError(EngineDeadError):
    """A tensor-parallel worker (rank ``rank`` >= 1) failed to start, died, or raised inside a step: the
    engine cannot run another step (:class:`~layerzero.engine.executor.multiproc.MultiprocExecutor`; the other
    workers are stopped). ``remote_type``: the worker's exception class name when it reported one, else None
    (it exited: ``exitcode``)."""

    def __init__(
        self, message: str, rank: int, remote_type: str | None = None, exitcode: int | None = None
    ) -> None:
        super().__init__(message)
        self.rank, self.remote_type, self.exitcode = rank, remote_type, exitcode
