"""Synchronized selection: rank 0 decides every rank's kernel (see ``docs/distributed.md``).

:func:`sync_selection` checks that every rank of the group runs the same LayerZero, torch, backends and device
model (:mod:`.fingerprint`), invalidates the selection cache and installs a :class:`SelectionSync` as the
runtime's coordinator. From then on a cache miss (never a hit) on any rank is one ``all_gather_object`` over
the group: each rank sends the call's context and, rank 0, its own choice; every rank then checks the same
gathered list the same way, so an error is raised on all ranks alike (no rank is left waiting), and otherwise
runs rank 0's kernel. Each decision is kept per key for the life of the sync (a rank-local cache eviction or
invalidation re-uses it without communicating), so collectives happen exactly at the first call of each new
key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ..core.context import SelectionContext
from ..core.dispatch import Runtime
from ..core.errors import (
    ConfigurationError,
    CudaGraphUnsafeError,
    DistributedMismatchError,
    DistributedSelectionError,
    NoKernelFoundError,
)
from ..core.report import CandidateReport, CandidateStatus, SelectionReport
from ..core.runtime import get_runtime
from ..core.selection import bind, kernel_reasons
from ..core.specs import ExecutionPlan
from .fingerprint import fingerprint, first_mismatch, mismatch_text

__all__ = ["SelectionSync", "current", "sync_selection", "unsync"]

log = logging.getLogger("layerzero.distributed")

_SPMD = (
    "After lz.distributed.sync_selection() every rank must call the same LayerZero ops with the same shapes, "
    "dtypes and flags in the same order (SPMD), from one thread; a call only some ranks make, on inputs no "
    "rank has seen before, waits for the others (docs/distributed.md)."
)


_KIND = "lz.selection"
"""The ``kind`` of a synchronized selection's gathered entry (a rank in another collective sends something
else)."""


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class SelectionSync:
    """The active synchronized-selection mode of this process (returned by :func:`sync_selection`).

    Attributes: ``group`` (the process group; None = the default group), ``rank`` and ``world_size`` (in the
    group). Use it as a context manager to leave the mode on exit (``with lz.distributed.sync_selection():
    ...``), or call :meth:`close` / :func:`unsync`.
    """

    def __init__(self, runtime: Runtime, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._runtime = runtime
        self._table: dict[Hashable, tuple[ExecutionPlan, SelectionReport]] = {}
        self._lock = threading.Lock()
        self._seq = 0
        self._closed = False

    # ------------------------------------------------------------------ public
    @property
    def active(self) -> bool:
        """True until :meth:`close` (or :func:`unsync`)."""
        return not self._closed

    def decisions(self) -> dict[Hashable, str]:
        """The kernel id decided for each cache key so far (this rank's keys; rank 0 chose every one)."""
        with self._lock:
            return {key: plan.kernel_id for key, (plan, _) in self._table.items()}

    def close(self) -> None:
        """Leave the mode on this rank: forget the decisions and invalidate the selection cache, so the next
        calls select locally again. No communication; call it on every rank (a rank still synchronized would
        wait for the others at its next new key)."""
        if self._closed:
            return
        self._closed = True
        if self._runtime.coordinator is self:
            self._runtime.coordinator = None
        with self._lock:
            self._table.clear()
        self._runtime.cache.invalidate()

    def __enter__(self) -> SelectionSync:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "active" if self.active else "closed"
        return (
            f"SelectionSync(rank={self.rank}, world_size={self.world_size}, {state}, {len(self._table)} "
            "decisions)"
        )

    # ------------------------------------------------------------------ the runtime's coordinator protocol
    def select(
        self, runtime: Runtime, key: Hashable, ctx: SelectionContext, quiet: bool
    ) -> tuple[ExecutionPlan, SelectionReport]:
        """The plan and report of ``key`` on this rank: rank 0's kernel for the same call (collective on the
        first miss of ``key``, the kept decision afterwards).

        Raises:
            DistributedMismatchError: the ranks' calls differ (op or a context field; SPMD broken), on every
                rank.
            DistributedSelectionError: rank 0's kernel cannot run a rank's inputs or is not registered there
                (every rank), or the collective failed or timed out (this rank).
            NoKernelFoundError: rank 0 found no kernel (a lock that cannot run, strict mode), on every rank.
            CudaGraphUnsafeError: a new key while a CUDA graph is being captured (no collective inside a
                capture).
        """
        if self._closed:
            return runtime.select_context(ctx, quiet=quiet)
        with self._lock:
            kept = self._table.get(key)
            if kept is not None:
                return kept
            if _capturing():
                raise CudaGraphUnsafeError(
                    f"lz.{ctx.op}: a synchronized selection (lz.distributed.sync_selection) needs a "
                    "collective, which cannot run while a CUDA graph is being captured. Run the op once "
                    "eagerly with the same inputs before capturing (that also decides the capture-time "
                    "kernel), or lz.warmup(op, cases)."
                )
            decided = self._decide(runtime, ctx, quiet)
            self._table[key] = decided
            return decided

    def explain(self, runtime: Runtime, key: Hashable, ctx: SelectionContext) -> SelectionReport:
        """``lz.explain`` in this mode (no communication): the kept report when ``key`` was decided (it notes
        that the choice came from rank 0), else this rank's own selection with a note that the first call of
        these inputs will be decided by rank 0."""
        if key.__class__ is tuple:
            key = runtime.named_key(key)  # type: ignore[arg-type]
        with self._lock:
            kept = self._table.get(key)
        if kept is not None:
            return kept[1]
        report = runtime.report_for(ctx)
        who = "decides it for all ranks" if self.rank == 0 else "runs rank 0's choice"
        note = (
            f"distributed: selection is synchronized over {self.world_size} ranks but these inputs have not "
            f"been called yet: this is rank {self.rank}'s own view; their first call {who}"
        )
        return replace(report, notes=(*report.notes, note))

    # ------------------------------------------------------------------ the protocol of one miss
    def _decide(
        self, runtime: Runtime, ctx: SelectionContext, quiet: bool
    ) -> tuple[ExecutionPlan, SelectionReport]:
        plan, report, error = _local(runtime, ctx, quiet or self.rank != 0)
        entry: dict[str, Any] = {
            "kind": _KIND,
            "seq": self._seq,
            "op": ctx.op,
            "fields": ctx.fields(),
            "choice": None if plan is None else plan.kernel_id,
            "locked": None if report is None else report.locked,
            "notes": () if report is None else tuple(report.notes),
            "error": None
            if error is None
            else (type(error).__name__, str(error), isinstance(error, NoKernelFoundError)),
        }
        if self.rank != 0:
            entry["kernels"], entry["cannot"] = _runnable(runtime, ctx)
        what = f"the synchronized selection #{self._seq} (op {ctx.op!r})"
        entries = self._gather(entry, what)
        self._seq += 1
        self._check_same_call(entries, what)
        ref = entries[0]
        if ref["error"] is not None:
            if self.rank == 0 and error is not None:
                raise error
            name, text, no_kernel = ref["error"]
            msg = f"{what}: rank 0, which decides for all ranks, raised {name}: {text}"
            raise NoKernelFoundError(msg) if no_kernel else DistributedSelectionError(msg, rank=0)
        choice = ref["choice"]
        for rank, e in enumerate(entries[1:], start=1):
            if choice not in e["kernels"]:
                raise DistributedSelectionError(
                    f"{what}: rank 0 chose {choice}, which is not registered on {self._who(rank)} (register "
                    "the same kernels on every rank, e.g. lz.register_kernel before sync_selection).",
                    rank=rank,
                )
            why = e["cannot"].get(choice)
            if why:
                raise DistributedSelectionError(
                    f"{what}: rank 0 chose {choice}, which cannot run {self._who(rank)}'s inputs: {why}. "
                    "Ranks must have the same kernels available for the same inputs (same device model, "
                    "libraries and input layout); a different kernel on one rank is never used in this "
                    "mode.",
                    rank=rank,
                )
        if self.rank == 0 and plan is not None and report is not None:  # rank 0 without a plan raised above
            report = replace(
                report,
                notes=(
                    *report.notes,
                    f"distributed: rank 0's choice, used by all "
                    f"{self.world_size} ranks (lz.distributed.sync_selection)",
                ),
            )
            return replace(plan, fallbacks=(), recheck_at=None, trial=False, report=report), report
        report = _follower_report(ctx, report, choice, ref, self.rank, self.world_size)
        spec = runtime.registry.kernel(choice, ctx.op)
        call, transforms, _ = bind(runtime.registry, spec, ctx)
        return ExecutionPlan(ctx.op, choice, call, transforms, ref["locked"] is not None, (), report), report

    def _check_same_call(self, entries: list[dict[str, Any]], what: str) -> None:
        ref = entries[0]
        for rank, e in enumerate(entries):
            if not isinstance(e, dict) or e.get("kind") != _KIND:
                got = e.get("kind") if isinstance(e, dict) else type(e).__name__
                raise DistributedMismatchError(
                    f"{what}: {self._who(rank)} took part in another collective ({got!r}) while this one "
                    "ran: the ranks' calls are out of step (one rank reused a kept choice or made a call "
                    f"the others did not). {_SPMD}",
                    rank=rank,
                    field="collective",
                    expected=_KIND,
                    got=got,
                )
        for rank, e in enumerate(entries[1:], start=1):
            diffs = [(name, ref[name], e[name]) for name in ("seq", "op") if e[name] != ref[name]]
            names = [*ref["fields"], *(k for k in e["fields"] if k not in ref["fields"])]
            diffs += [
                (name, ref["fields"].get(name), e["fields"].get(name))
                for name in names
                if ref["fields"].get(name) != e["fields"].get(name)
            ]
            if diffs:
                name, v0, vr = diffs[0]
                field = "sequence number" if name == "seq" else name
                raise DistributedMismatchError(
                    f"{what}: {self._who(rank)} made a different call than rank 0 ({field}: rank 0 has "
                    f"{v0!r}, {self._who(rank)} has {vr!r}; {len(diffs)} field(s) differ). {_SPMD}",
                    rank=rank,
                    field=field,
                    expected=v0,
                    got=vr,
                )

    def _gather(self, obj: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as exc:  # noqa: BLE001 - any transport failure becomes the typed error
            raise DistributedSelectionError(
                f"{self._who(self.rank)}: {what} failed in its collective ({type(exc).__name__}: {exc}). "
                f"{_SPMD} The wait is bounded by the process group's timeout "
                "(init_process_group(timeout=...)).",
                rank=self.rank,
            ) from exc
        return out

    def _who(self, rank: int) -> str:
        if self.group is None or self.group is dist.group.WORLD:
            return f"rank {rank}"
        return f"rank {rank} (global rank {dist.get_global_rank(self.group, rank)})"


def _local(
    runtime: Runtime, ctx: SelectionContext, quiet: bool
) -> tuple[ExecutionPlan | None, SelectionReport | None, Exception | None]:
    """This rank's own selection; an error is returned, not raised (it must reach the collective first)."""
    try:
        plan, report = runtime.select_context(ctx, quiet=quiet)
        return plan, report, None
    except NoKernelFoundError as exc:
        return None, exc.report, exc
    except Exception as exc:  # noqa: BLE001 - raised after the collective, on every rank alike
        return None, None, exc


def _runnable(runtime: Runtime, ctx: SelectionContext) -> tuple[list[str], dict[str, str]]:
    """The op's kernel ids on this rank, and why each kernel that cannot run ``ctx`` cannot: availability,
    data constraints and the kernel's own check. Policy, free memory and backend health are this rank's own
    view and are left out: rank 0's view of them decides."""
    reg = runtime.registry
    ids, cannot = [], {}
    for spec in reg.for_op(ctx.op):
        ids.append(spec.kernel_id)
        try:
            reasons = kernel_reasons(reg, spec, ctx)
        except Exception as exc:  # noqa: BLE001 - a failing check is a reason, reported on every rank
            reasons = [f"its check raised {type(exc).__name__}: {exc}"]  # type: ignore[list-item]
        if reasons:
            cannot[spec.kernel_id] = "; ".join(str(r) for r in reasons)
    return ids, cannot


def _follower_report(
    ctx: SelectionContext,
    local: SelectionReport | None,
    choice: str,
    ref: dict[str, Any],
    rank: int,
    world_size: int,
) -> SelectionReport:
    """This rank's report with rank 0's ``choice`` selected (its own candidates, reasons and scores kept)."""
    mine = None if local is None else local.chosen
    note = (
        f"distributed: {choice} is rank 0's choice, used by all {world_size} ranks "
        f"(lz.distributed.sync_selection); rank {rank} alone would have chosen {mine or 'no kernel'}"
    )
    candidates: list[CandidateReport] = []
    for c in () if local is None else local.candidates:
        if c.kernel_id == choice:
            c = replace(c, status=CandidateStatus.SELECTED)
        elif c.status is CandidateStatus.SELECTED:
            c = replace(c, status=CandidateStatus.ELIGIBLE)
        candidates.append(c)
    if not any(c.kernel_id == choice for c in candidates):
        candidates.insert(0, CandidateReport(choice, CandidateStatus.SELECTED))
    notes = (note, *(f"rank 0: {n}" for n in ref["notes"]))
    return SelectionReport(
        ctx.op,
        ctx,
        choice,
        tuple(candidates),
        ref["locked"],
        "" if local is None else local.policy_hash,
        notes,
        None if local is None else local.shipped_source,
    )


def sync_selection(group: Any = None, *, device: torch.device | str | int | None = None) -> SelectionSync:
    """From now on, every rank of ``group`` runs rank 0's kernel for the same inputs (TP-invariant mode).

    Collective: call it on every rank of ``group`` after ``torch.distributed.init_process_group``. It gathers
    a fingerprint from each rank (LayerZero, torch, CUDA/HIP and cuDNN versions, the device model and SM,
    every backend's installed version and availability, the registered kernel ids) and refuses any difference
    from rank 0 on every rank alike. Then the selection cache is invalidated; each new key's first call on any
    rank becomes one small collective in which rank 0's choice (made with rank 0's policy, PerfDB, shipped
    timings, free memory and backend health) is adopted by every rank; cache hits communicate nothing and cost
    what they did. The ranks must make the same LayerZero calls in the same order (SPMD, one thread per rank):
    see ``docs/distributed.md``. Calling it again (on every rank) starts over: new fingerprint check,
    decisions dropped.

    Args:
        group: a ``torch.distributed`` process group; None: the default group. Rank 0 is the group's first
            rank.
        device: the device whose model is compared (None: the current CUDA device when CUDA is available, else
            the CPU). With NCCL, call ``torch.cuda.set_device(local_rank)`` first (as NCCL itself needs).

    Returns:
        The :class:`SelectionSync` now in force (a context manager that leaves the mode on exit).

    Raises:
        ConfigurationError: ``torch.distributed`` is unavailable or not initialized, or this process is not in
            ``group``.
        DistributedMismatchError: a rank's fingerprint differs from rank 0's (``.rank``, ``.field``,
            ``.expected`` = rank 0's value, ``.got``), raised on every rank.
        DistributedSelectionError: the fingerprint collective itself failed (timeout, a rank gone).
        CudaGraphUnsafeError: called while a CUDA graph is being captured.

    >>> import layerzero as lz
    >>> sync = lz.distributed.sync_selection()  # doctest: +SKIP
    >>> y = lz.rms_norm(x, w)  # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigurationError(
            "lz.distributed.sync_selection: torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group(...) on every rank first."
        )
    if _capturing():
        raise CudaGraphUnsafeError(
            "lz.distributed.sync_selection cannot run while a CUDA graph is being captured."
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ConfigurationError(
            "lz.distributed.sync_selection: this process is not a member of the given group; "
            "call it only on the group's ranks."
        )
    runtime = get_runtime()
    runtime.ensure_ready()
    pending = SelectionSync(runtime, group, rank, world)
    prints = pending._gather(
        fingerprint(runtime, device), "lz.distributed.sync_selection (fingerprint exchange)"
    )
    bad = first_mismatch(prints)
    if bad is not None:
        r, field, expected, got = bad
        raise DistributedMismatchError(
            f"lz.distributed.sync_selection refused: {pending._who(r)} differs from rank 0 in {field!r} "
            f"({mismatch_text(field, expected, got)}). Every rank must run the same LayerZero, torch and "
            "backend versions on the same device model for all of them to run rank 0's kernels; install the "
            "same versions everywhere (`layerzero doctor` on each node shows them).",
            rank=r,
            field=field,
            expected=expected,
            got=got,
        )
    previous = runtime.coordinator
    if isinstance(previous, SelectionSync):
        previous.close()
    runtime.coordinator = pending
    runtime.cache.invalidate()
    log.info(
        "LayerZero: kernel selection synchronized over %d ranks (this is rank %d); rank 0 decides",
        world,
        rank,
    )
    return pending


def current() -> SelectionSync | None:
    """The :class:`SelectionSync` in force in this process, or None."""
    coordinator = get_runtime().coordinator
    return coordinator if isinstance(coordinator, SelectionSync) else None


def unsync() -> bool:
    """Leave synchronized selection on this rank (see :meth:`SelectionSync.close`). Returns True if it was on,
    False otherwise; never raises. No communication: call it on every rank."""
    sync = current()
    if sync is None:
        return False
    sync.close()
    return True
