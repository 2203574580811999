"""The selection pipeline: filter -> score -> select (the cache is the caller's, see ``dispatch``).

- **filter**: every candidate gets *all* its reasons: backend availability, data constraints, the kernel's
  own ``check``, backend health, and policy (lock / deny / allow).
- **score**: priority (``capture_priority`` while a CUDA graph is captured; ``priority_for(ctx)`` where a
  kernel declares one) + policy boost + measurement - transform cost; the measurement is the user's PerfDB
  (``perf``) or, when the PerfDB has nothing for the bucket, the shipped timing data (``shipped``).
- **select**: highest score wins. The reference kernel survives policy so there is always a fallback;
  a lock forces its kernel and raises if it cannot run; a preference that cannot run, or the reference
  standing in for rejected faster kernels, is a *fallback*: logged with its reasons, or raised in strict mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from .constraints import check_constraints
from .context import SelectionContext
from .errors import NoKernelFoundError
from .policy import Policy
from .reasons import Reason, ReasonCode
from .registry import KernelRegistry
from .report import CandidateReport, CandidateStatus, Score, SelectionReport
from .specs import ExecutionPlan, KernelSpec

log = logging.getLogger("layerzero.selection")
R = ReasonCode

_POLICY_CODES = frozenset({R.POLICY_DENIED, R.POLICY_NOT_ALLOWED, R.POLICY_LOCKED_OTHER, R.POLICY_DISABLED})


class Measurement(NamedTuple):
    """What measurements add to one kernel's score.

    ``perf`` / ``measured_us``: the PerfDB term and median (µs); ``shipped`` / ``shipped_us``: the shipped
    timing data's term and median (µs), used only when the PerfDB has nothing for the bucket; ``source``:
    where the shipped median comes from (file, exact or nearest bucket), None without one.
    """

    perf: float = 0.0
    measured_us: float | None = None
    shipped: float = 0.0
    shipped_us: float | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class SelectionInputs:
    """What a selection reads besides the context: policy, backend health and measured timings.

    ``usable(backend_id) -> Reason | None`` answers health; ``perf(kernel_id)`` gives the measurement terms: a
    :class:`Measurement`, or a ``(perf score, median_us)`` pair for the PerfDB term alone (``(0.0, None)``
    when unmeasured). ``free_bytes()``: the device's free memory in bytes, or None when unknown (no workspace
    check); read at most once per selection, and only when a candidate declares a workspace. A kernel whose
    workspace exceeds ``free_bytes() - headroom_bytes`` is rejected with ``WORKSPACE_TOO_LARGE``.
    """

    policy: Policy
    usable: Callable[[str], Reason | None]
    perf: Callable[[str], Measurement | tuple[float, float | None]]
    strict: bool = False
    log_fallbacks: bool = True
    free_bytes: Callable[[], int | None] | None = None
    headroom_bytes: int = 0


def kernel_reasons(
    registry: KernelRegistry,
    spec: KernelSpec,
    ctx: SelectionContext,
    usable: Callable[[str], Reason | None] | None = None,
) -> list[Reason]:
    """Every non-policy reason ``spec`` cannot run ``ctx``: availability, constraints, own check, health."""
    reasons: list[Reason] = []
    backend = registry.backend(spec.backend)
    if not backend.available:
        reasons.extend(
            backend.reasons
            or (Reason(R.BACKEND_NOT_INSTALLED, f"backend {backend.backend_id} is not available"),)
        )
    reasons.extend(check_constraints(spec, ctx))
    if spec.check is not None and backend.available:
        reasons.extend(spec.check(ctx))
    if usable is not None:
        unhealthy = usable(spec.backend)
        if unhealthy is not None:
            reasons.append(unhealthy)
    return reasons


def bind(
    registry: KernelRegistry, spec: KernelSpec, ctx: SelectionContext
) -> tuple[Any, tuple[str, ...], float]:
    """The callable dispatch would run for ``spec`` on ``ctx`` (specialized, wrapped in the op's layout
    adapter), its transform names and transform cost. Used by selection and by ``lz.tune``. Made once per
    (kernel, context) and shared (:meth:`KernelRegistry.bound`): a lock, a preference and the default choice
    of the same kernel run the same object."""

    def make() -> tuple[Any, tuple[str, ...], float]:
        fn = (spec.specialize(ctx) if spec.specialize is not None else None) or spec.fn
        adapter = registry.ops.get(ctx.op).adapter
        if adapter is None:
            return fn, (), 0.0
        return adapter(spec, ctx, fn)

    return registry.bound(spec, ctx, make)


def select(
    registry: KernelRegistry, ctx: SelectionContext, inputs: SelectionInputs
) -> tuple[ExecutionPlan, SelectionReport]:
    """Run filter -> score -> select for ``ctx``.

    Returns the chosen :class:`ExecutionPlan` (with the other eligible kernels as runtime fallbacks) and its
    :class:`SelectionReport`. Raises ``NoKernelFoundError`` (with ``.report``) when a locked kernel cannot
    run, or in strict mode when selection had to fall back; ``UnknownOperationError`` for an unknown op.
    """
    op = ctx.op
    fields = ctx.fields()
    policy = inputs.policy
    lock = policy.lock_for(op, fields)
    locked_id = None if lock is None else lock.kernel
    specs = registry.for_op(op)
    if locked_id is not None:
        registry.kernel(locked_id, op)  # typed error when a lock names an unknown kernel / other op

    candidates: list[CandidateReport] = []
    eligible: list[tuple[float, int, KernelSpec, Any, tuple[str, ...], Score]] = []
    boosted_rejects: list[tuple[str, tuple[Reason, ...]]] = []
    shipped_source: str | None = None
    free: list[int | None] = []  # the device's free bytes, read on the first declared workspace
    for order, spec in enumerate(specs):
        reasons = kernel_reasons(registry, spec, ctx, inputs.usable)
        if inputs.free_bytes is not None and spec.workspace is not None:
            reasons.extend(_workspace_reasons(spec, ctx, inputs, free))
        boost = policy.boost(op, spec.kernel_id, spec.backend, fields)
        if locked_id is not None and spec.kernel_id != locked_id:
            reasons.append(Reason(R.POLICY_LOCKED_OTHER, f"op {op!r} is locked to {locked_id}"))
        elif locked_id is None and not spec.is_reference:
            reasons.extend(policy.reasons_against(op, spec.kernel_id, spec.backend, fields))
        if reasons:
            candidates.append(CandidateReport(spec.kernel_id, CandidateStatus.REJECTED, tuple(reasons)))
            if boost > 0 and not any(r.code in _POLICY_CODES for r in reasons):
                boosted_rejects.append((spec.kernel_id, tuple(reasons)))
            continue
        call, transforms, cost = bind(registry, spec, ctx)
        m = inputs.perf(spec.kernel_id)
        m = m if isinstance(m, Measurement) else Measurement(*m)
        shipped_source = shipped_source or m.source
        prio = (
            spec.capture_priority
            if ctx.graph_capture and spec.capture_priority is not None
            else spec.priority
        )
        if spec.priority_for is not None:
            own = spec.priority_for(ctx)
            prio = prio if own is None else own
        score = Score(priority=float(prio), boost=boost, perf=m.perf, transform_cost=cost, shipped=m.shipped)
        eligible.append((score.total, -order, spec, call, transforms, score))
        candidates.append(
            CandidateReport(
                spec.kernel_id, CandidateStatus.ELIGIBLE, (), score, transforms, m.measured_us, m.shipped_us
            )
        )

    policy_hash = policy.hash
    if locked_id is not None and not eligible:
        report = SelectionReport(
            op,
            ctx,
            None,
            tuple(candidates),
            locked_id,
            policy_hash,
            (f"lock: {locked_id} cannot run these inputs",),
        )
        why = "; ".join(str(r) for r in report.candidate(locked_id).reasons)
        raise NoKernelFoundError(
            f"op {op!r} is locked to {locked_id}, which cannot run these inputs: {why}. "
            f"Remove the lock (lz.unlock({op!r}) or the policy's locks entry) or change the inputs.",
            report,
        )
    if not eligible:
        report = SelectionReport(op, ctx, None, tuple(candidates), None, policy_hash)
        raise NoKernelFoundError(f"no kernel can run op {op!r} for these inputs.\n{report}", report)

    eligible.sort(key=lambda e: (e[0], e[1]), reverse=True)
    _, _, best, call, transforms, _ = eligible[0]
    notes = _fallback_notes(registry, best, candidates, boosted_rejects)
    chosen_reports = tuple(
        replace(c, status=CandidateStatus.SELECTED) if c.kernel_id == best.kernel_id else c
        for c in candidates
    )
    report = SelectionReport(
        op, ctx, best.kernel_id, chosen_reports, locked_id, policy_hash, notes, shipped_source
    )
    if notes:
        if inputs.strict:
            raise NoKernelFoundError(
                f"strict mode: selection for op {op!r} would fall back ({' | '.join(notes)}). "
                "Fix the inputs or policy, or lz.configure(strict=False) to allow fallbacks.",
                report,
            )
        if inputs.log_fallbacks:
            log.warning("LayerZero %s: %s", op, " | ".join(notes))
    fallbacks = (
        tuple(ExecutionPlan(op, spec.kernel_id, c, tr) for _, _, spec, c, tr, _ in eligible[1:])
        if locked_id is None
        else ()
    )
    plan = ExecutionPlan(op, best.kernel_id, call, transforms, locked_id is not None, fallbacks, report)
    return plan, report


def _workspace_reasons(
    spec: KernelSpec, ctx: SelectionContext, inputs: SelectionInputs, free: list[int | None]
) -> list[Reason]:
    """``WORKSPACE_TOO_LARGE`` when ``spec``'s workspace for ``ctx`` exceeds the free device memory minus the
    headroom (``free`` caches the one memory reading of this selection)."""
    need = spec.workspace_bytes(ctx)
    if need <= 0:
        return []
    if not free:
        free.append(inputs.free_bytes())  # type: ignore[misc] - the caller checked it is set
    have = free[0]
    if have is None or need <= have - inputs.headroom_bytes:
        return []
    mib = 1 << 20
    return [
        Reason(
            R.WORKSPACE_TOO_LARGE,
            f"needs {need / mib:.1f} MiB of workspace; the device has {have / mib:.1f} MiB free and "
            f"{inputs.headroom_bytes / mib:.1f} MiB are kept as headroom (lz.configure("
            "workspace_headroom_bytes=...); free memory is read when a key is first selected)",
        )
    ]


def _fallback_notes(
    registry: KernelRegistry,
    best: KernelSpec,
    candidates: list[CandidateReport],
    boosted_rejects: list[tuple[str, tuple[Reason, ...]]],
) -> tuple[str, ...]:
    notes = []
    for kernel_id, reasons in boosted_rejects:
        notes.append(
            f"fallback: preferred {kernel_id} cannot run ({'; '.join(str(r) for r in reasons)}); "
            f"using {best.kernel_id}"
        )
    if best.is_reference:
        blocked = [
            c
            for c in candidates
            if c.status is CandidateStatus.REJECTED
            and not any(r.code in _POLICY_CODES or r.code is R.DEVICE_TYPE_UNSUPPORTED for r in c.reasons)
            and registry.backend(registry.kernel(c.kernel_id).backend).available
        ]
        if blocked:
            why = "; ".join(f"{c.kernel_id}: {', '.join(r.code.value for r in c.reasons)}" for c in blocked)
            notes.append(f"fallback: reference kernel {best.kernel_id} serves this call because {why}")
    return tuple(notes)


def validate_kernel(
    registry: KernelRegistry,
    kernel_id: str,
    ctx: SelectionContext,
    usable: Callable[[str], Reason | None] | None = None,
    policy: Policy | None = None,
    fields: Mapping[str, Any] | None = None,
) -> list[Reason]:
    """All reasons ``kernel_id`` cannot run ``ctx`` (empty = can run); policy reasons when ``policy``
    given."""
    spec = registry.kernel(kernel_id, ctx.op)
    reasons = kernel_reasons(registry, spec, ctx, usable)
    if policy is not None and not spec.is_reference:
        reasons.extend(policy.reasons_against(ctx.op, spec.kernel_id, spec.backend, fields or ctx.fields()))
    return reasons
