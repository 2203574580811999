"""``lz.solve`` (manifest -> :class:`DispatchTable`) and ``lz.install_table`` / ``lz.uninstall_table``
(install a table; the old names ``lz.compile`` / ``lz.uncompile`` are deprecated aliases).

A compiled table is a :class:`~layerzero.core.dispatch.SelectionCoordinator`: ``Runtime.select_cached`` asks
it on cache misses only, so the cache-hit path is unchanged. For a miss whose ``(op, bucket)`` the table has,
the table's kernel is validated (registered, its constraints/check, backend health and policy deny pass for
the context) and bound without scoring; a bucket the table lacks goes through normal selection and is logged
once ("not in the compiled table"), or raises :class:`TableMissError` in strict mode (not for capture-time
keys: they select among graph-safe kernels as usual). An ``lz.lock`` matching the call wins over the table
(force is force). It cannot be combined with ``lz.distributed.sync_selection`` (which also owns the
coordinator slot): compiling while one is active raises ``ConfigurationError``.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Hashable
from dataclasses import replace
from typing import Any

from layerzero.core import config as _config
from layerzero.core.errors import ConfigurationError, NoKernelFoundError
from layerzero.core.report import CandidateReport, CandidateStatus, SelectionReport
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import bind, validate_kernel
from layerzero.core.specs import ExecutionPlan

from .manifest import Manifest
from .table import DispatchTable, TableEntry, current_fingerprint

log = logging.getLogger("layerzero.planning")


class TableMissError(NoKernelFoundError):
    """Strict compiled mode: a call's bucket is not in the compiled table (or its kernel cannot run it)."""


def _prepared(where: str, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from layerzero.api import _prepared as prep

    return prep(where, op, args, kwargs)


def _why(report: SelectionReport) -> str:
    chosen = report.candidate(report.chosen) if report.chosen else None
    eligible = sum(c.status is not CandidateStatus.REJECTED for c in report.candidates)
    rejected = len(report.candidates) - eligible
    if report.locked:
        head = f"locked ({report.locked})"
    elif chosen is not None and chosen.score is not None:
        s = chosen.score
        head = (
            f"score {s.total:.1f} (priority {s.priority:g}, boost {s.boost:g}, perf {s.perf:.1f}, "
            f"shipped {s.shipped:.1f})"
        )
    else:
        head = "chosen"
    return f"{head}; {eligible} eligible, {rejected} rejected"


def entry_of(report: SelectionReport) -> TableEntry:
    """The :class:`TableEntry` of one selection report."""
    ctx = report.context
    chosen = report.candidate(report.chosen) if report.chosen else None
    rejected = {
        c.kernel_id: [r.code.value if hasattr(r.code, "value") else str(r.code) for r in c.reasons]
        for c in report.candidates
        if c.status is CandidateStatus.REJECTED
    }
    fields = {k: v for k, v in ctx.fields().items() if v is not None}
    return TableEntry(
        ctx.op,
        ctx.bucket_key(),
        ctx.device.device_type,
        report.chosen or "",
        _why(report),
        fields,
        rejected,
        tuple(report.notes),
        None if chosen is None else chosen.measured_us,
    )


def solve(cases_or_manifest: Any, *, target: str | None = None) -> DispatchTable:
    """Select a kernel for every case's op x shape bucket (no kernel runs) and return the
    :class:`DispatchTable`.

    Args:
        cases_or_manifest: a :class:`Manifest`, a list of ``(op, args, kwargs)`` (as ``lz.tune`` takes
            ``(args, kwargs)`` per op), or a path to a JSON manifest (materialized on ``target``).
        target: device for a JSON manifest's tensor specs (``"cpu"``, ``"cuda"``); ignored for real tensors.

    Returns:
        A :class:`DispatchTable` with, per bucket, the kernel id, a score summary, rejected kernels' reason
        codes and the PerfDB median where measured; fingerprinted with this device, versions and policy hash.
        Cases of one bucket share one entry (the first). CUDA cases also get their capture-time (graph-safe)
        entry.

    Raises:
        ManifestError: malformed cases. UnknownOperationError / InvalidInputError: the op's own errors.
        NoKernelFoundError: a case no kernel can run (a lock that cannot run it, strict mode).
    """
    import os

    if isinstance(cases_or_manifest, (str, os.PathLike)):
        from .manifest import load_manifest

        manifest = load_manifest(cases_or_manifest, device=target)
    else:
        manifest = Manifest.of(cases_or_manifest, "lz.solve(cases)")
    RUNTIME.ensure_ready()
    entries: dict[tuple[str, str], TableEntry] = {}
    for i, case in enumerate(manifest):
        key, context = _prepared(f"lz.solve case {i}", case.op, case.args, case.kwargs)
        ctx = context(RUNTIME.named_key(key) if key.__class__ is tuple else key)
        _, report = RUNTIME.select_context(ctx, quiet=True)
        entry = entry_of(report)
        entries.setdefault((entry.op, entry.bucket), entry)
        if ctx.device.device_type == "cuda":  # the capture-time choice too (graph-safe kernels only)
            try:
                _, cap_report = RUNTIME.select_context(replace(ctx, graph_capture=True), quiet=True)
            except NoKernelFoundError:
                continue  # no graph-safe kernel: a capture of this call raises with the reasons
            cap = entry_of(cap_report)
            entries.setdefault((cap.op, cap.bucket), cap)
    devices = {e.device for e in entries.values()}
    return DispatchTable(tuple(entries.values()), current_fingerprint(devices))


class CompiledTable:
    """The coordinator ``lz.install_table`` installs (see the module docstring). ``missed``: buckets not in
    the table that were selected normally, in order (each logged once)."""

    def __init__(self, table: DispatchTable, strict: bool) -> None:
        self.table, self.strict = table, strict
        self.missed: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _log_miss(self, op: str, bucket: str, why: str) -> None:
        with self._lock:
            if (op, bucket) in self.missed:
                return
            self.missed.append((op, bucket))
        log.warning(
            "LayerZero %s: bucket %s %s; selecting normally (lz.install_table(strict=True) raises instead)",
            op,
            bucket,
            why,
        )

    def _decide(self, runtime: Any, ctx: Any, quiet: bool) -> tuple[ExecutionPlan, SelectionReport] | None:
        bucket = ctx.bucket_key()
        entry = self.table.lookup(ctx.op, bucket)
        policy = _config.effective_policy()
        fields = ctx.fields()
        if entry is None:
            if self.strict and not ctx.graph_capture:
                raise TableMissError(
                    f"lz.{ctx.op}: bucket {bucket} is not in the compiled dispatch table and "
                    "lz.install_table(strict=True) refuses to select. Add the shape to the manifest and "
                    "solve again, or compile with strict=False."
                )
            if not ctx.graph_capture:
                self._log_miss(ctx.op, bucket, "is not in the compiled table")
            return None
        if policy.lock_for(ctx.op, fields) is not None:
            return None  # force is force: a lock wins over the table (normal selection honours it)
        reg = runtime.registry
        try:
            reasons: list[Any] = validate_kernel(
                reg, entry.kernel_id, ctx, runtime.usable_reason, policy, fields
            )
        except ConfigurationError as exc:  # kernel no longer registered
            reasons = [str(exc)]
        if reasons:
            text = "; ".join(str(r) for r in reasons)
            if self.strict:
                raise TableMissError(
                    f"lz.{ctx.op}: the compiled table's kernel {entry.kernel_id} cannot run bucket "
                    f"{bucket}: {text}. Solve the table again."
                )
            self._log_miss(
                ctx.op, bucket, f"has table kernel {entry.kernel_id}, which cannot run it ({text})"
            )
            return None
        spec = reg.kernel(entry.kernel_id, ctx.op)
        call, transforms, _ = bind(reg, spec, ctx)
        fallbacks: tuple[ExecutionPlan, ...] = ()
        ref_id = reg.ops.get(ctx.op).reference_kernel
        if ref_id != entry.kernel_id and ref_id in reg.kernels:
            ref = reg.kernel(ref_id, ctx.op)
            rcall, rtrans, _ = bind(reg, ref, ctx)
            fallbacks = (ExecutionPlan(ctx.op, ref_id, rcall, rtrans),)
        note = (
            f"compiled table: {entry.kernel_id} chosen by lz.install_table's dispatch table ({entry.why}); "
            "no selection ran"
        )
        report = SelectionReport(
            ctx.op,
            ctx,
            entry.kernel_id,
            (CandidateReport(entry.kernel_id, CandidateStatus.SELECTED, measured_us=entry.measured_us),),
            None,
            policy.hash,
            (note,),
        )
        return ExecutionPlan(ctx.op, entry.kernel_id, call, transforms, False, fallbacks, report), report

    def select(
        self, runtime: Any, key: Hashable, ctx: Any, quiet: bool
    ) -> tuple[ExecutionPlan, SelectionReport]:
        """The table's plan for ``ctx``'s bucket, else normal selection (see the module docstring)."""
        decided = self._decide(runtime, ctx, quiet)
        if decided is not None:
            return decided
        plan, report = runtime.select_context(ctx, quiet=quiet)
        note = "compiled table: bucket not in the table (or its kernel cannot run it); selected normally"
        report = _noted(report, note)
        return plan, report

    def explain(self, runtime: Any, key: Hashable, ctx: Any) -> SelectionReport:
        """``lz.explain``'s report: the table's choice (noted), or the normal report with a note."""
        decided = self._decide(runtime, ctx, True)
        if decided is not None:
            return decided[1]
        report = runtime.report_for(ctx)
        return _noted(report, "compiled table: bucket not in the table; selected normally")


def _noted(report: SelectionReport, note: str) -> SelectionReport:
    return replace(report, notes=(*report.notes, note))


def install_table(table: DispatchTable, *, strict: bool = False, check: bool = True) -> CompiledTable:
    """Install ``table``: from now on a cache miss of a bucket the table has runs the table's kernel without
    scoring (validated for the call's context); other buckets select normally (logged once each) or, with
    ``strict=True``, raise :class:`TableMissError`. Cached choices are invalidated; cache hits cost what they
    did.

    Returns the installed :class:`CompiledTable` (``.missed`` lists the buckets that fell back).

    Raises:
        TableMismatchError: ``check`` and the table's fingerprint differs from this process.
        ConfigurationError: ``table`` is not a DispatchTable, or ``lz.distributed.sync_selection`` is active.
    """
    if not isinstance(table, DispatchTable):
        raise ConfigurationError(
            f"lz.install_table(table): expected a DispatchTable (lz.solve / lz.load_table), "
            f"got {type(table).__name__}."
        )
    RUNTIME.ensure_ready()
    current = RUNTIME.coordinator
    if current is not None and not isinstance(current, CompiledTable):
        raise ConfigurationError(
            "lz.install_table: kernel choices are already decided by another coordinator "
            f"({type(current).__name__}, e.g. lz.distributed.sync_selection); a compiled table "
            "and synchronized selection cannot be combined. Close the other one first."
        )
    if check:
        table.check()
    compiled = CompiledTable(table, strict)
    RUNTIME.coordinator = compiled
    RUNTIME.cache.invalidate()
    return compiled


def uninstall_table() -> bool:
    """Remove the compiled table (cached choices are invalidated). Returns True when one was installed, False
    otherwise; never raises."""
    if isinstance(RUNTIME.coordinator, CompiledTable):
        RUNTIME.coordinator = None
        RUNTIME.cache.invalidate()
        return True
    return False


def compile(table: DispatchTable, *, strict: bool = False, check: bool = True) -> CompiledTable:  # noqa: A001
    """Deprecated name of :func:`install_table` (it read like ``torch.compile`` and shadowed the builtin);
    kept for one release. Warns ``DeprecationWarning``; raises what :func:`install_table` raises."""
    warnings.warn(
        "lz.compile is deprecated: use lz.install_table (same arguments)", DeprecationWarning, stacklevel=2
    )
    return install_table(table, strict=strict, check=check)


def uncompile() -> bool:
    """Deprecated name of :func:`uninstall_table`, kept for one release (warns ``DeprecationWarning``)."""
    warnings.warn("lz.uncompile is deprecated: use lz.uninstall_table", DeprecationWarning, stacklevel=2)
    return uninstall_table()


def compiled_table() -> CompiledTable | None:
    """The installed :class:`CompiledTable`, or None."""
    current = RUNTIME.coordinator
    return current if isinstance(current, CompiledTable) else None


__all__ = [
    "CompiledTable",
    "TableMissError",
    "compile",
    "compiled_table",
    "entry_of",
    "install_table",
    "solve",
    "uncompile",
    "uninstall_table",
]
