"""Typed LayerZero errors.

Every error LayerZero raises is a :class:`LayerZeroError` and also a builtin (``ValueError``,
``RuntimeError`` or ``TimeoutError``) so callers that already catch those keep working. A message
says what failed, what was expected versus what was got, and how to fix it; :func:`expected_got`
builds that shape so every module words it the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class LayerZeroError(Exception):
    """Base class of every error LayerZero raises on purpose."""


class InvalidInputError(LayerZeroError, ValueError):
    """An op was called with tensors or arguments it cannot accept (shape, dtype, device, range)."""


class NoKernelFoundError(LayerZeroError, RuntimeError):
    """No registered kernel can run these inputs under the current policy.

    ``report`` holds the :class:`~layerzero.core.report.SelectionReport` with every candidate's reasons.
    """

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class KernelExecutionError(LayerZeroError, RuntimeError):
    """A selected kernel raised while running and no fallback was allowed (lock or strict mode)."""


class PolicyValidationError(LayerZeroError, ValueError):
    """A policy (YAML, dict or environment) is malformed, unsafe or names unknown things."""


class BackendNotAvailableError(LayerZeroError, RuntimeError):
    """A backend was asked for explicitly but is not installed or not usable here."""


class ConfigurationError(LayerZeroError, ValueError):
    """A configuration option, op id or kernel id is unknown or out of range."""


class UnknownOperationError(ConfigurationError):
    """An op id that no :class:`~layerzero.core.specs.OperationSpec` is registered for."""


class UnknownKernelError(ConfigurationError):
    """A kernel id that is not registered (or is registered for another op)."""


class CudaGraphUnsafeError(LayerZeroError, RuntimeError):
    """Work that is not allowed while a CUDA graph is being captured was requested."""


class SelectionTimeoutError(LayerZeroError, TimeoutError):
    """Waiting for another thread's selection of the same key took longer than allowed."""


class CacheCorruptionError(LayerZeroError, RuntimeError):
    """A persistent store (PerfDB, plan cache) failed its integrity check."""


class DistributedMismatchError(ConfigurationError):
    """Ranks disagree on something that synchronized selection (``lz.distributed``) needs equal on all of
    them.

    At ``sync_selection``: a library or backend version, availability, the device model or the registered
    kernels; at a synchronized cache miss: the call itself (op, shapes, dtypes, flags: the ranks are not
    running the same ops in the same order). Raised on every rank of the group alike.

    ``rank``: the first rank (in the group) that differs from rank 0; ``field``: what differs; ``expected``:
    rank 0's value; ``got``: that rank's value.
    """

    def __init__(self, message: str, *, rank: int, field: str, expected: Any, got: Any) -> None:
        super().__init__(message)
        self.rank, self.field, self.expected, self.got = rank, field, expected, got


class DistributedSelectionError(LayerZeroError, RuntimeError):
    """A synchronized selection (``lz.distributed``) could not complete.

    Rank 0's kernel cannot run a rank's inputs (or is not registered there): raised on every rank; or the
    collective that shares rank 0's choice failed or timed out (a rank made a call the others did not): raised
    on the waiting rank. ``rank``: the rank the message is about (None when unknown)."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class IsolatedWorkerError(LayerZeroError, RuntimeError):
    """An isolated backend's worker process (``layerzero.isolation``) failed a call: it died (``exit_code``:
    its exit status, negative for a signal; ``stderr_tail``: the end of its output), could not start, or the
    kernel raised inside it (``remote_type``: the exception's type name, ``remote_traceback``: its traceback
    as text, never a pickled exception).

    Dispatch treats it as a kernel failure (``kernel_failure = True``): an unlocked call falls back to the
    next kernel and charges the backend's health; a locked one raises ``KernelExecutionError`` from it."""

    kernel_failure = True

    def __init__(
        self,
        message: str,
        *,
        exit_code: int | None = None,
        stderr_tail: str = "",
        remote_type: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.exit_code, self.stderr_tail = exit_code, stderr_tail
        self.remote_type, self.remote_traceback = remote_type, remote_traceback


class IsolatedWorkerTimeoutError(IsolatedWorkerError, TimeoutError):
    """An isolated worker did not answer within its ``timeout_s``; it was killed (the next call restarts
    it)."""


def expected_got(what: str, expected: Any, got: Any, fix: str | None = None) -> str:
    """Format ``"<what>: expected <expected>, got <got>. <fix>"`` — the house style of error messages."""
    msg = f"{what}: expected {expected}, got {got}."
    if fix:
        msg += f" {fix}"
    return msg


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """Return ``" Known: [...]"`` plus a close match when there is one, for unknown-name errors."""
    import difflib

    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{hint} Known: {known}."
