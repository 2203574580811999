"""Correctness canaries and the quarantine they fill.

With ``lz.configure(canaries=True)``, the first call of each new selection-cache key whose plan is not the
reference kernel is checked against the reference kernel on the same inputs (``Runtime.canary``, installed by
the package above core, ``layerzero/_wiring.py``, as the ``lz.tune`` correctness check with its per-dtype
tolerances). A failure quarantines ``backend@version@arch``: persisted in a ``quarantine`` table of the
PerfDB's SQLite file, so every later selection on that device architecture rejects the backend's kernels with
``BACKEND_QUARANTINED`` (in this and later processes), and the failed call is served again by the re-selected
kernel (its wrong output is never returned). A new backend version lifts it (the version is part of the
entry); ``layerzero quarantine --clear`` (or :meth:`QuarantineStore.clear`) lifts it by hand;
``layerzero doctor`` lists the entries.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .device import DeviceSpec
from .errors import ConfigurationError
from .reasons import Reason, ReasonCode
from .shipped import device_fingerprint

if TYPE_CHECKING:
    from .cache import SelectionCache
    from .registry import KernelRegistry
    from .specs import ExecutionPlan

__all__ = ["CanaryRuntime", "QuarantineEntry", "QuarantineStore", "arch_of", "probe_first_call"]

log = logging.getLogger("layerzero.quarantine")


def arch_of(device: DeviceSpec) -> str:
    """The architecture a quarantine entry is scoped to: CUDA ``name|sm``; CPU ``machine|isa level|ATen ISA``;
    other devices ``type|name`` (library versions are left out: the backend's version is its own field)."""
    fp = device_fingerprint(device)
    keys = {"cuda": ("name", "sm"), "cpu": ("arch", "isa", "aten_isa")}.get(
        device.device_type, ("device_type", "name")
    )
    return f"{device.device_type}:" + "|".join(fp.get(k, "") for k in keys)


@dataclass(frozen=True)
class QuarantineEntry:
    """One quarantined ``backend@version@arch``: the kernel whose canary failed, why, and when (Unix time)."""

    backend: str
    version: str
    arch: str
    kernel: str
    reason: str
    created: float

    def __str__(self) -> str:
        return f"{self.backend}@{self.version}@{self.arch}: {self.kernel} failed its canary ({self.reason})"


class QuarantineStore:
    """Quarantine entries in the ``quarantine`` table of a SQLite file (the PerfDB's), cached in memory.

    Raises:
        ConfigurationError: the file cannot be opened or is not a SQLite database (message says which).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(path, check_same_thread=False, timeout=10.0)
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS quarantine (backend TEXT, version TEXT, arch TEXT, "
                "kernel TEXT, reason TEXT, created REAL, PRIMARY KEY (backend, version, arch))"
            )
            self._conn.commit()
            rows = self._conn.execute(
                "SELECT backend, version, arch, kernel, reason, created FROM quarantine"
            )
            self._entries = {(r[0], r[1], r[2]): QuarantineEntry(*r) for r in rows}
        except sqlite3.Error as exc:
            raise ConfigurationError(
                f"quarantine store {path}: cannot open it as SQLite ({exc}). Point "
                "lz.configure(perfdb_path=...) at a writable file."
            ) from exc

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[QuarantineEntry]:
        """Every entry, oldest first."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.created)

    def lookup(self, backend: str, version: str | None, arch: str) -> QuarantineEntry | None:
        """The entry of ``backend`` at this ``version`` on ``arch``, or None."""
        return self._entries.get((backend, version or "none", arch))

    def add(self, backend: str, version: str | None, arch: str, kernel: str, reason: str) -> QuarantineEntry:
        """Quarantine ``backend@version@arch`` (replacing an entry of the same three) and persist it."""
        e = QuarantineEntry(backend, version or "none", arch, kernel, reason[:500], time.time())
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?, ?, ?)",
                (e.backend, e.version, e.arch, e.kernel, e.reason, e.created),
            )
            self._conn.commit()
            self._entries[(e.backend, e.version, e.arch)] = e
        return e

    def clear(self, backend: str | None = None) -> int:
        """Lift every entry (or only ``backend``'s); returns how many were lifted."""
        with self._lock:
            gone = [k for k in self._entries if backend is None or k[0] == backend]
            for k in gone:
                self._conn.execute("DELETE FROM quarantine WHERE backend = ? AND version = ? AND arch = ?", k)
                del self._entries[k]
            self._conn.commit()
        return len(gone)

    def reason_for(self, backend: str, version: str | None, arch: str) -> Reason | None:
        """``BACKEND_QUARANTINED`` when the backend is quarantined at this version on ``arch``, else None."""
        e = self.lookup(backend, version, arch)
        if e is None:
            return None
        return Reason(
            ReasonCode.BACKEND_QUARANTINED,
            f"{e} (lift it: `layerzero quarantine --clear {backend}`, or install another version)",
        )


class CanaryRuntime(Protocol):
    """What :func:`probe_first_call` uses of the runtime (a ``core.dispatch.Runtime``, named here by its
    members: this module sits below dispatch and does not import it)."""

    registry: KernelRegistry
    cache: SelectionCache[ExecutionPlan]
    canary: Callable[..., str | None] | None

    def quarantine(self) -> QuarantineStore | None:
        """The quarantine store (None when the PerfDB is off or unusable)."""
        ...

    def resolve(
        self, key: Hashable, build_ctx: Callable[[Any], Any], *, refresh: bool = False
    ) -> ExecutionPlan:
        """The plan of ``key``: cached, or selected now and cached."""
        ...


def probe_first_call(
    runtime: CanaryRuntime,
    key: Hashable,
    build_ctx: Callable[[Hashable], Any],
    args: tuple[Any, ...],
    plan: ExecutionPlan,
    out: Any,
) -> Any:
    """The canary of a key's first call: ``out`` when the plan's kernel agrees with the reference (or cannot
    be checked); otherwise quarantine its backend, re-select, and return the new plan's output for the same
    args."""
    ctx = build_ctx(key)
    spec = runtime.registry.kernel(plan.kernel_id, ctx.op)
    if spec.is_reference or ctx.graph_capture or runtime.canary is None:
        return out
    store = runtime.quarantine()  # no store (PerfDB off): nothing could record a failure, so no reference run
    if store is None:
        return out
    failure = runtime.canary(runtime, ctx, args, out)
    if failure is None:
        return out
    backend = runtime.registry.backend(spec.backend)
    entry = store.add(spec.backend, backend.version, arch_of(ctx.device), plan.kernel_id, failure)
    log.error("LayerZero %s: canary failed, quarantined %s; re-selecting", ctx.op, entry)
    runtime.cache.invalidate()
    again = runtime.resolve(key, build_ctx)
    return again.call(*args)
