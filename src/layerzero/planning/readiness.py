"""``lz.readiness_check()``: can this process serve? One :class:`ReadinessReport` of named checks.

Checks: ``backends`` (at least one available backend besides the reference; none whose circuit breaker is
open), ``perfdb`` (openable, or disabled by config: ok), ``table`` (a compiled or given dispatch table matches
this process's fingerprint; ok when there is none), ``warm`` (every key warmed by ``lz.warmup`` has run its
kernel once and is still served by it; ok when nothing was warmed, with a note), ``graph_safe`` (CUDA warmed
keys have a capture-time choice cached; skipped on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layerzero.core.capture import capture_key
from layerzero.core.errors import LayerZeroError
from layerzero.core.health import BreakerState
from layerzero.core.runtime import RUNTIME


@dataclass(frozen=True)
class Check:
    """One readiness check: ``name``, ``ok``, ``detail``."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class ReadinessReport:
    """``ok`` when every check passed; ``checks`` in order; ``bool(report)`` is ``ok``; ``str()`` a table."""

    checks: tuple[Check, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __bool__(self) -> bool:
        return self.ok

    def check(self, name: str) -> Check:
        """The check called ``name`` (KeyError when absent)."""
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """``{"ok": bool, "checks": [{"name", "ok", "detail"}]}``."""
        return {"ok": self.ok, "checks": [c.__dict__ for c in self.checks]}

    def __str__(self) -> str:
        head = "READY" if self.ok else "NOT READY"
        return "\n".join(
            [head, *(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks)]
        )


def _backends() -> Check:
    reg = RUNTIME.registry
    avail = [b.backend_id for b in reg.backends.values() if b.available]
    opened = [b for b in avail if RUNTIME.health.state(b) is BreakerState.OPEN]
    usable = [b for b in avail if b not in opened and b != "reference"]
    ok = bool(usable) and not opened
    detail = f"available: {', '.join(sorted(avail)) or '-'}"
    if opened:
        detail += f"; circuit breaker open: {', '.join(sorted(opened))}"
    if not usable:
        detail += "; no backend besides the reference is usable"
    return Check("backends", ok, detail)


def _perfdb() -> Check:
    from layerzero.core import config as _config

    if not _config.get_config().use_perfdb:
        return Check("perfdb", True, "disabled (use_perfdb=False)")
    db = RUNTIME.perfdb()
    if db is None:
        return Check("perfdb", False, "the configured PerfDB cannot be opened (see the WARNING log)")
    return Check("perfdb", True, f"open at {RUNTIME._perfdb_path}")


def _table(table: Any) -> Check:
    from .solve import compiled_table

    compiled = compiled_table()
    t = table if table is not None else (compiled.table if compiled is not None else None)
    if t is None:
        return Check("table", True, "no dispatch table compiled or given")
    try:
        t.check()
    except LayerZeroError as exc:
        return Check("table", False, str(exc))
    where = "compiled" if table is None else "given"
    missed = (
        f"; {len(compiled.missed)} bucket(s) fell back" if compiled is not None and compiled.missed else ""
    )
    return Check("table", True, f"{where} table of {len(t)} entries matches this process{missed}")


def _warm() -> tuple[Check, Check]:
    from .warmup import WARMED

    keys = list(WARMED.values())
    if not keys:
        note = "nothing warmed with lz.warmup(manifest): first calls will select and compile"
        return Check("warm", True, note), Check("graph_safe", True, "no warmed CUDA keys")
    cold = []
    for w in keys:
        plan = RUNTIME.cache.get(w.key)
        if not w.ran or plan is None:
            cold.append(
                f"{w.op} {w.bucket}: {'not run' if not w.ran else 'not cached (cache invalidated since)'}"
            )
        elif plan.kernel_id != w.kernel_id:
            cold.append(f"{w.op} {w.bucket}: now {plan.kernel_id}, warmed {w.kernel_id}")
    warm = Check(
        "warm",
        not cold,
        f"{len(keys) - len(cold)}/{len(keys)} warmed keys run and cached"
        + (f"; cold: {'; '.join(cold[:5])}" if cold else ""),
    )
    cuda = [w for w in keys if w.device_type == "cuda"]
    if not cuda:
        return warm, Check("graph_safe", True, "no warmed CUDA keys (skipped)")
    missing = [
        f"{w.op} {w.bucket}"
        for w in cuda
        if capture_key(w.key) is not None and RUNTIME.cache.get(capture_key(w.key)) is None
    ]
    return warm, Check(
        "graph_safe",
        not missing,
        f"{len(cuda) - len(missing)}/{len(cuda)} CUDA keys have a "
        "capture-time choice" + (f"; missing: {'; '.join(missing[:5])}" if missing else ""),
    )


def readiness_check(table: Any = None) -> ReadinessReport:
    """Answer "can this process serve?" (see the module docstring). ``table``: a :class:`DispatchTable` to
    check instead of the compiled one. Returns a :class:`ReadinessReport` (``ok``: every check passed;
    ``checks``: rows of (name, ok, detail): backends and health, PerfDB, table fingerprint, warmed keys,
    graph-safe capture choices). Never raises for a failed check: it is a row with ``ok=False``."""
    RUNTIME.ensure_ready()
    warm, graph = _warm()
    return ReadinessReport((_backends(), _perfdb(), _table(table), warm, graph))


__all__ = ["Check", "ReadinessReport", "readiness_check"]
