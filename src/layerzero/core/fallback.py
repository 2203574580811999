"""What dispatch does when a kernel raises at run time: retry on the next eligible kernels, or re-raise.

:class:`RuntimeFallback` is a part of :class:`~layerzero.core.dispatch.Runtime` (a base class of it). Every
path that calls a plan (the hot paths in ``core/dispatch.py``, the ops' inlined hot path through
``Runtime.hot_failure``) hands a kernel's exception to :meth:`RuntimeFallback._on_failure`.
"""

from __future__ import annotations

import logging
from typing import Any

from . import config as _config
from .errors import KernelExecutionError, LayerZeroError
from .health import HealthTracker
from .observers import DispatchTrace
from .specs import ExecutionPlan
from .telemetry import TELEMETRY

__all__ = ["RuntimeFallback"]

log = logging.getLogger("layerzero.dispatch")


class RuntimeFallback:
    """Run-time fallback of a runtime (:meth:`_on_failure`): uses its ``health`` and ``coordinator``."""

    # the Runtime's state (set in Runtime.__init__)
    health: HealthTracker
    coordinator: Any  # a core.dispatch.SelectionCoordinator, or None

    def _on_failure(
        self, plan: ExecutionPlan, exc: Exception, args: tuple[Any, ...], t: DispatchTrace | None
    ) -> Any:
        """Retry a failed call on the next eligible kernels.

        A backend's health counter is charged only when another kernel then succeeds on the same inputs:
        that proves the kernel, not the data (NaN logits, say), was at fault. When every kernel fails the
        inputs are to blame, no backend is charged, and ``KernelExecutionError`` lists every error.
        ``t``: the caller's ``lz.trace()`` block (None: none), which records the fallbacks and the kernel that
        served the call.
        """
        if isinstance(exc, LayerZeroError) and not getattr(exc, "kernel_failure", False):
            # LayerZero's own errors pass through; a kernel_failure one (a dead isolated worker) is retried
            raise exc
        failed = [(plan, exc)]
        if plan.locked or _config.get_config().strict or not plan.fallbacks:
            why = (
                "it is locked"
                if plan.locked
                else "strict mode is on"
                if plan.fallbacks
                else "kernel choices are synchronized across ranks (lz.distributed.sync_selection)"
                if self.coordinator is not None
                else "no other kernel is eligible"
            )
            raise KernelExecutionError(
                f"kernel {plan.kernel_id} failed for op {plan.op!r} and no fallback is tried because {why}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        for nxt in plan.fallbacks:
            log.warning(
                "LayerZero %s: kernel %s failed at run time (%s: %s); retrying with %s",
                plan.op,
                failed[-1][0].kernel_id,
                type(failed[-1][1]).__name__,
                failed[-1][1],
                nxt.kernel_id,
            )
            if t is not None:
                t.fallbacks.append(
                    (plan.op, failed[-1][0].kernel_id, f"{type(failed[-1][1]).__name__}: {failed[-1][1]}")
                )
            try:
                out = nxt.call(*args)
            except Exception as again:  # noqa: BLE001
                failed.append((nxt, again))
                continue
            for bad, error in failed:
                self.health.record_failure(bad.backend, error)
            if TELEMETRY.on:
                TELEMETRY.runtime_fallback(plan.op, failed[0][1])
            if t is not None:
                t.counts[(nxt.op, nxt.kernel_id)] += 1
            return out
        errors = " | ".join(f"{p.kernel_id}: {type(e).__name__}: {e}" for p, e in failed)
        raise KernelExecutionError(
            f"every eligible kernel failed for op {plan.op!r}, so the inputs are the likely cause (for "
            f"example NaN/inf values) and no backend was marked unhealthy: {errors}"
        ) from failed[-1][1]
