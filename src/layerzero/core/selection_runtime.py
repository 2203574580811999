"""The runtime's selection: a context to a plan and its report, and a cache key to its cached plan.

:class:`RuntimeSelection` is a part of :class:`~layerzero.core.dispatch.Runtime` (a base class of it): it runs
:func:`layerzero.core.selection.select` with the runtime's health, quarantine, PerfDB and free-memory readings
(:meth:`~RuntimeSelection.select_context`), asks the coordinator instead when one is set
(:meth:`~RuntimeSelection.select_cached`), and fills the selection cache single-flight per key
(:meth:`~RuntimeSelection.resolve`). Only cache misses come here; hits never leave ``core/dispatch.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

from . import config as _config
from .cache import SelectionCache
from .capture import capturing_now
from .context import ContextBuilder, SelectionContext
from .device import DeviceSpec
from .errors import CudaGraphUnsafeError, LayerZeroError, NoKernelFoundError
from .health import BreakerState, HealthTracker
from .quarantine import arch_of
from .reasons import Reason
from .registry import KernelRegistry
from .report import SelectionReport
from .selection import SelectionInputs, select
from .specs import ExecutionPlan
from .telemetry import TELEMETRY

__all__ = ["RuntimeSelection"]


class RuntimeSelection:
    """Selection for a runtime: :meth:`select_context` (the full pipeline, no cache), :meth:`report_for`,
    :meth:`select_cached` (the coordinator's decision when one is set), :meth:`resolve` (cached,
    single-flight) and the named form of a plain-tuple key (:meth:`named_key`)."""

    # the Runtime's state (set in Runtime.__init__) and its other parts' methods that selection uses
    registry: KernelRegistry
    cache: SelectionCache[ExecutionPlan]
    health: HealthTracker
    coordinator: Any  # a core.dispatch.SelectionCoordinator, or None
    free_memory: Callable[[DeviceSpec], int | None]
    ensure_ready: Callable[[], None]
    quarantine: Callable[[], Any]
    _quarantine_if_open: Callable[[], Any]
    _perf_lookup: Callable[[SelectionContext], Any]

    def usable_reason(self, backend_id: str) -> Reason | None:
        """None when ``backend_id``'s circuit breaker lets it run, else the ``BACKEND_UNHEALTHY`` reason."""
        return None if self.health.usable(backend_id) else self.health.reason(backend_id)

    def select_context(
        self, ctx: SelectionContext, *, quiet: bool = False
    ) -> tuple[ExecutionPlan, SelectionReport]:
        """Run the full pipeline for ``ctx`` (no cache): the plan and its report. ``quiet``: fallback notes
        stay in the report but are not logged (a choice prepared ahead of a capture that may never happen)."""
        self.ensure_ready()
        cfg = _config.get_config()
        usable = self.usable_reason
        # a capture-time choice (prepared eagerly, or selected inside a capture when allowed) reads the store
        # only if it is open already: its entries are in memory, opening it is file I/O
        store = self._quarantine_if_open() if ctx.graph_capture else self.quarantine()
        if store:  # entries exist: check each backend against them
            arch, reg = arch_of(ctx.device), self.registry

            def usable(b: str) -> Reason | None:
                """Health first, then the quarantine entry of backend ``b`` at its version on this arch."""
                return self.usable_reason(b) or store.reason_for(b, reg.backend(b).version, arch)

        inputs = SelectionInputs(
            _config.effective_policy(),
            usable,
            self._perf_lookup(ctx),
            cfg.strict,
            cfg.log_fallbacks and not quiet,
            lambda: self.free_memory(ctx.device),
            cfg.workspace_headroom_bytes,
        )
        plan, report = select(self.registry, ctx, inputs)
        retry_at = self.health.next_retry_at()
        trial = self.health.state(plan.backend) is BreakerState.HALF_OPEN
        if retry_at is not None or trial:
            plan = replace(plan, recheck_at=retry_at, trial=trial)
        return plan, report

    def report_for(self, ctx: SelectionContext) -> SelectionReport:
        """The :class:`SelectionReport` of ``ctx`` (:meth:`select_context`), also when selection raises
        ``NoKernelFoundError`` with a report (a lock that cannot run: the report says why)."""
        try:
            return self.select_context(ctx)[1]
        except NoKernelFoundError as exc:
            if exc.report is None:
                raise
            return exc.report

    def select_cached(
        self, key: Hashable, ctx: SelectionContext, *, quiet: bool = False
    ) -> tuple[ExecutionPlan, SelectionReport]:
        """The plan and report to cache for ``key`` (context ``ctx``): :meth:`select_context`, or the
        :attr:`coordinator`'s decision when one is set."""
        coordinator = self.coordinator
        if coordinator is None:
            return self.select_context(ctx, quiet=quiet)
        return coordinator.select(self, key, ctx, quiet)

    def resolve(self, key: Hashable, build_ctx: ContextBuilder, *, refresh: bool = False) -> ExecutionPlan:
        """The plan for ``key`` (named or plain-tuple form): from the cache, or selected now (single-flight)
        and cached."""
        self.ensure_ready()
        key = self._named(key)
        if refresh:
            self.health.poll()
            self.cache.invalidate()

        def compute() -> ExecutionPlan:
            """Select ``key``'s plan (a cache miss; never inside a real capture unless allowed)."""
            ctx = build_ctx(self._named(key))
            if ctx.graph_capture and not _config.get_config().allow_selection_in_capture and capturing_now():
                raise CudaGraphUnsafeError(
                    f"lz.{ctx.op}: no cached kernel choice for these inputs while a CUDA graph is being "
                    "captured, and selection must not run inside a capture. Run the op once eagerly with the "
                    "same shapes, dtypes and flags before capturing (the first eager call prepares the "
                    "capture-time choice), or call lz.warmup(op, cases), or "
                    "lz.configure(allow_selection_in_capture=True) to allow it." + _graph_safe_hint(self, ctx)
                )
            t0 = time.perf_counter()
            plan, report = self.select_cached(key, ctx)
            if TELEMETRY.on:
                TELEMETRY.selected(ctx.op, plan.kernel_id, time.perf_counter() - t0, report)
            return plan

        return self.cache.get_or_compute(key, compute, timeout_s=_config.get_config().selection_timeout_s)

    def _named(self, key: Hashable) -> Hashable:
        """``key`` in its named form. Every internal entry point names its key again: under ``torch.compile``,
        TorchDynamo rebuilds a NamedTuple local as a plain tuple when it resumes a frame after a graph break
        (seen on CUDA with torch 2.11: the attention key reached its context builder as a tuple)."""
        return self.named_key(key) if key.__class__ is tuple else key

    def named_key(self, key: tuple[Any, ...]) -> Hashable:
        """The op's named key (:attr:`OperationSpec.key_type`) of ``key``, the plain-tuple form an op's hot
        path builds (its first field is the op id); ``key`` itself for any other key."""
        self.ensure_ready()
        op = key[0] if key else None
        if op.__class__ is str and op in self.registry.ops:
            key_type = self.registry.ops.get(op).key_type
            if key_type is not None:
                # the constructor: TorchDynamo mis-traces tuple.__new__ of a NamedTuple
                return key_type(*key)
        return key


def _graph_safe_hint(runtime: RuntimeSelection, ctx: SelectionContext) -> str:
    """Why no graph-safe kernel can run ``ctx``, when that is the case (for the capture-miss error)."""
    try:
        runtime.select_context(ctx)
    except NoKernelFoundError as exc:
        return f" Note: no graph-safe kernel can run these inputs at all: {str(exc).splitlines()[0]}"
    except LayerZeroError:
        return ""
    return ""
