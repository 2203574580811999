"""Dispatch: the hot path from a cache key to a kernel call, and what happens when a kernel fails.

A call's key (built by ``layerzero.ops``) is looked up in the sharded :class:`SelectionCache`. A hit
returns an :class:`ExecutionPlan` and calls it: a dict lookup, one generation compare and the kernel call.
A miss builds the :class:`SelectionContext` *from the key*, runs :func:`selection.select` (single-flight
per key) and caches the plan. If the kernel raises, its backend's health counter records it and the call is
retried on the next eligible kernel (never for a lock; strict mode raises instead).

The backends are not imported here (``core`` imports no backend): whoever builds the :class:`Runtime` passes
a ``loader`` that registers them on first use.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import replace
from typing import Any, Protocol

from . import config as _config
from . import shipped as _shipped
from .cache import SelectionCache
from .capture import capture_key, capturing_now, rng_kept
from .context import SelectionContext
from .device import DeviceSpec, device_free_bytes
from .errors import CudaGraphUnsafeError, KernelExecutionError, LayerZeroError, NoKernelFoundError
from .health import BreakerState, HealthTracker
from .observers import OBSERVERS
from .perfdb import PerfDB, fingerprint, perf_score
from .quarantine import QuarantineStore, arch_of, probe_first_call
from .reasons import Reason
from .registry import KernelRegistry
from .report import SelectionReport
from .selection import Measurement, SelectionInputs, select
from .specs import ExecutionPlan
from .telemetry import TELEMETRY

log = logging.getLogger("layerzero.dispatch")

ContextBuilder = Callable[[tuple[Any, ...]], SelectionContext]


class DispatchTrace:
    """Counts of ``(op, kernel_id)`` dispatched inside an ``lz.trace()`` block (``.counts``), plus the
    fallbacks that happened (``.fallbacks``: ``(op, failed kernel, error text)``)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.fallbacks: list[tuple[str, str, str]] = []

    def kernels_for(self, op: str) -> list[str]:
        """Kernel ids that served ``op`` in this block, most used first."""
        return [k for (o, k), _ in self.counts.most_common() if o == op]


_TRACE: contextvars.ContextVar[DispatchTrace | None] = contextvars.ContextVar("layerzero_trace", default=None)

MISS = object()
"""What :meth:`Runtime.run_hot` returns when its key is not in the hot dict (no kernel returns this object)."""


@contextlib.contextmanager
def trace() -> Iterator[DispatchTrace]:
    """Record which kernel served each op call inside the block (this thread/task only); yields a
    :class:`DispatchTrace`. Raises nothing; errors of the ops inside propagate unchanged."""
    t = DispatchTrace()
    OBSERVERS.enter()  # the ops' inlined hot path counts nothing: they take run_hot meanwhile
    token = _TRACE.set(t)
    try:
        yield t
    finally:
        _TRACE.reset(token)
        OBSERVERS.leave()


class SelectionCoordinator(Protocol):
    """Decides the plans that go into the selection cache in place of :meth:`Runtime.select_context` while it is
    set as :attr:`Runtime.coordinator` (``layerzero.distributed.sync_selection``: rank 0's choice on every rank).
    Called on cache misses only (never on a hit), with the op's named ``key`` and its context."""

    def select(self, runtime: Runtime, key: Hashable, ctx: SelectionContext,
               quiet: bool) -> tuple[ExecutionPlan, SelectionReport]: ...

    def explain(self, runtime: Runtime, key: Hashable, ctx: SelectionContext) -> SelectionReport:
        """``lz.explain``'s report for ``key`` in this mode (must not communicate)."""
        ...


class Runtime:
    """Holds the registry, selection cache, health tracker and PerfDB; runs selections and calls.

    Cheap to construct (no I/O): the environment, backends and PerfDB are loaded on the first miss.
    """

    def __init__(self, loader: Callable[[KernelRegistry], None],
                 autotuner: Callable[[Runtime, SelectionContext, tuple[Any, ...]], None] | None = None,
                 canary: Callable[[Runtime, SelectionContext, tuple[Any, ...], Any], str | None] | None = None) -> None:
        self._loader = loader
        self.canary = canary
        """Called as ``canary(runtime, ctx, args, out)`` on a new key's first call with ``lz.configure(canaries=True)``:
        None when ``out`` agrees with the reference, else why not (``core/quarantine.py``)."""
        self._quarantine: QuarantineStore | None = None
        self.coordinator: SelectionCoordinator | None = None
        """When set, the plans of cache misses (eager and capture-time keys) come from ``coordinator.select``
        instead of :meth:`select_context`; ``layerzero.distributed.sync_selection`` sets it. None: local choice."""
        self.autotuner = autotuner
        """Called as ``autotuner(runtime, ctx, args)`` on the first eager call of a new key when
        ``lz.configure(autotune=True)``, before selection (``layerzero.tuning.autotune.autotune_context``)."""
        self.free_memory: Callable[[DeviceSpec], int | None] = device_free_bytes
        """Free memory of a device in bytes, or None when unknown: memory-aware selection compares declared
        kernel workspaces with it (tests replace it with a fake reading)."""
        self._init_lock = threading.Lock()
        self._ready = False
        self.registry = KernelRegistry(on_change=_config.notify_change)
        self.cache: SelectionCache[ExecutionPlan] = SelectionCache()
        self._cache_shape: tuple[int, float | None] = (self.cache.max_entries, None)
        self.health = HealthTracker(on_change=self._on_health_change)
        self._perfdb: PerfDB | None = None
        self._perfdb_path: str | None = None
        self._perfdb_failed = False

    # ------------------------------------------------------------------ set-up
    def ensure_ready(self) -> None:
        """Load env config and register the built-in backends, once."""
        if self._ready:
            return
        with self._init_lock:
            if self._ready:
                return
            _config.ensure_env_loaded()
            self._loader(self.registry)
            path = _config.env_settings().capabilities_path
            if path:
                from .capabilities import apply_overrides, load_overrides

                changed = apply_overrides(self.registry, load_overrides(path))
                log.info("LayerZero capability overrides from %s applied to %s", path, changed)
            _config.add_listener(self._on_config_change)
            self._apply_config(_config.get_config())
            self._ready = True
        _config.notify_change()

    def _apply_config(self, cfg: _config.Config) -> None:
        if self._cache_shape != (cfg.cache_size, cfg.cache_ttl_s):
            self.cache = SelectionCache(max_entries=cfg.cache_size, ttl_s=cfg.cache_ttl_s)
            self._cache_shape = (cfg.cache_size, cfg.cache_ttl_s)
        if (self.health.failure_threshold, self.health.cooldown_s) != (cfg.health_failure_threshold,
                                                                       cfg.health_cooldown_s):
            self.health = HealthTracker(cfg.health_failure_threshold, cfg.health_cooldown_s,
                                        on_change=self._on_health_change)

    def _on_config_change(self) -> None:
        self._apply_config(_config.get_config())
        self.cache.invalidate()

    def _on_health_change(self, backend_id: str, state: BreakerState) -> None:
        log.warning("LayerZero backend %s circuit breaker is now %s", backend_id, state.value)
        if TELEMETRY.on and state is BreakerState.OPEN:
            TELEMETRY.health_trips[backend_id] += 1
        _config.notify_change()

    # ------------------------------------------------------------------ PerfDB
    def perfdb(self) -> PerfDB | None:
        """The PerfDB at the configured path (opened lazily), or None when disabled or unusable."""
        cfg = _config.get_config()
        if not cfg.use_perfdb:
            return None
        path = cfg.perfdb_path or _config.default_perfdb_path()
        if self._perfdb is not None and self._perfdb_path == path:
            return self._perfdb
        try:
            self._perfdb, self._perfdb_path, self._perfdb_failed = PerfDB(path), path, False
        except (LayerZeroError, OSError) as exc:
            if not self._perfdb_failed:
                log.warning("LayerZero PerfDB at %s is unusable (%s); selecting without measurements", path, exc)
            self._perfdb_failed = True
            return None
        return self._perfdb

    def quarantine(self) -> QuarantineStore | None:
        """The quarantine store in the PerfDB's file (None when the PerfDB is off or unusable)."""
        db = self.perfdb()
        if db is None:
            return None
        if self._quarantine is None or self._quarantine.path != self._perfdb_path:
            try:
                self._quarantine = QuarantineStore(self._perfdb_path or "")
            except LayerZeroError as exc:
                log.warning("LayerZero quarantine store unusable (%s); no canary quarantines", exc)
                return None
        return self._quarantine

    def _perf_lookup(self, ctx: SelectionContext) -> Callable[[str], Measurement]:
        """The measurement terms of ``ctx``'s kernels: from the PerfDB rows of the bucket when there are any,
        else from the timing data shipped for this device model and library versions (``core/shipped.py``;
        unless ``use_shipped_timings`` is off), else none. For a CUDA-graph capture context neither is read
        (no I/O inside a capture; and shipped data alone there would outrank the user's own measurements)."""
        nothing = Measurement()
        if ctx.graph_capture:
            return lambda _kid: nothing
        cfg = _config.get_config()
        db = self.perfdb()
        records = {}
        if db is not None:
            try:
                TELEMETRY.perfdb_reads += TELEMETRY.on
                records = db.for_bucket(ctx.op, ctx.bucket_key(), fingerprint(device_fingerprint_parts(ctx.device)))
            except LayerZeroError as exc:
                log.warning("LayerZero PerfDB read failed (%s); selecting without its measurements", exc)
        weight = cfg.perf_weight
        if records:
            def lookup(kernel_id: str) -> Measurement:
                rec = records.get(kernel_id)
                return Measurement(perf_score(records, kernel_id, weight), None if rec is None else rec.median_us)

            return lookup
        if not cfg.use_shipped_timings:
            return lambda _kid: nothing
        reg = self.registry

        def version(kernel_id: str) -> tuple[str, str | None] | None:
            if kernel_id not in reg.kernels:
                return None
            backend = reg.kernels.get(kernel_id).backend
            return backend, reg.backends.get(backend).version if backend in reg.backends else None

        match = _shipped.lookup(ctx, version, cfg.shipped_timings_dir)
        if match is None:
            return lambda _kid: nothing
        source = match.source
        margin = cfg.shipped_tie_margin
        if margin is None:
            margin = reg.ops.get(ctx.op).shipped_tie_margin if ctx.op in reg.ops else 0.0
        return lambda kid: Measurement(shipped=match.score(kid, weight, margin), shipped_us=match.median(kid),
                                       source=source)

    # ------------------------------------------------------------------ selection
    def usable_reason(self, backend_id: str) -> Reason | None:
        """None when ``backend_id``'s circuit breaker lets it run, else the ``BACKEND_UNHEALTHY`` reason."""
        return None if self.health.usable(backend_id) else self.health.reason(backend_id)

    def select_context(self, ctx: SelectionContext, *, quiet: bool = False) -> tuple[ExecutionPlan, SelectionReport]:
        """Run the full pipeline for ``ctx`` (no cache): the plan and its report. ``quiet``: fallback notes stay in
        the report but are not logged (a choice prepared ahead of a capture that may never happen)."""
        self.ensure_ready()
        cfg = _config.get_config()
        usable = self.usable_reason
        # a capture-time choice (prepared eagerly, or selected inside a capture when allowed) reads the store only
        # if it is open already: its entries are in memory, opening it is file I/O
        q = self._quarantine
        store = (q if q is not None and q.path == self._perfdb_path else None) if ctx.graph_capture \
            else self.quarantine()
        if store:  # entries exist: check each backend against them
            arch, reg = arch_of(ctx.device), self.registry

            def usable(b: str) -> Reason | None:
                return self.usable_reason(b) or store.reason_for(b, reg.backend(b).version, arch)
        inputs = SelectionInputs(_config.effective_policy(), usable, self._perf_lookup(ctx),
                                 cfg.strict, cfg.log_fallbacks and not quiet,
                                 lambda: self.free_memory(ctx.device), cfg.workspace_headroom_bytes)
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

    def select_cached(self, key: Hashable, ctx: SelectionContext, *,
                      quiet: bool = False) -> tuple[ExecutionPlan, SelectionReport]:
        """The plan and report to cache for ``key`` (context ``ctx``): :meth:`select_context`, or the
        :attr:`coordinator`'s decision when one is set."""
        coordinator = self.coordinator
        if coordinator is None:
            return self.select_context(ctx, quiet=quiet)
        return coordinator.select(self, key, ctx, quiet)

    def resolve(self, key: Hashable, build_ctx: ContextBuilder, *, refresh: bool = False) -> ExecutionPlan:
        """The plan for ``key`` (named or plain-tuple form): from the cache, or selected now (single-flight) and
        cached."""
        self.ensure_ready()
        key = self._named(key)
        if refresh:
            self.health.poll()
            self.cache.invalidate()

        def compute() -> ExecutionPlan:
            ctx = build_ctx(self._named(key))
            if ctx.graph_capture and not _config.get_config().allow_selection_in_capture and capturing_now():
                raise CudaGraphUnsafeError(
                    f"lz.{ctx.op}: no cached kernel choice for these inputs while a CUDA graph is being captured, "
                    "and selection must not run inside a capture. Run the op once eagerly with the same shapes, "
                    "dtypes and flags before capturing (the first eager call prepares the capture-time choice), or "
                    "call lz.warmup(op, cases), or lz.configure(allow_selection_in_capture=True) to allow it."
                    + _graph_safe_hint(self, ctx))
            t0 = time.perf_counter()
            plan, report = self.select_cached(key, ctx)
            if TELEMETRY.on:
                TELEMETRY.selected(ctx.op, plan.kernel_id, time.perf_counter() - t0, report)
            return plan

        return self.cache.get_or_compute(key, compute, timeout_s=_config.get_config().selection_timeout_s)

    # ------------------------------------------------------------------ the hot path
    def run(self, key: Hashable, build_ctx: ContextBuilder, args: tuple[Any, ...],
            hot_key: Hashable | None = None) -> Any:
        """Look ``key`` up, select on a miss, and call the plan with ``args`` (the op's canonical arguments).

        The hot path is one dict lookup (``SelectionCache.hot``) and the kernel call; anything else (a miss, a
        plan under health re-check or on probation: such plans never enter the hot dict, see :meth:`_run_slow`)
        takes :meth:`_run_slow`. ``key`` may be the plain-tuple form of the op's named key
        (:attr:`OperationSpec.key_type`). ``hot_key``: the op's exact key of this call for :meth:`run_hot`,
        filed in the hot dict next to ``key`` whenever ``key``'s plan is."""
        hot = self.cache.hot
        plan = hot.get(key)
        if plan is None:
            return self._run_slow(key, build_ctx, args, hot_key)
        if hot_key is not None:
            self.cache.promote(hot, hot_key, plan)
        if TELEMETRY.on:
            return self._observed(plan, args)
        t = _TRACE.get()
        if t is not None:
            t.counts[(plan.op, plan.kernel_id)] += 1
        try:
            return plan.call(*args)
        except Exception as exc:  # noqa: BLE001 - every kernel failure is recorded, then re-raised or retried
            return self._on_failure(plan, exc, args, t)

    def run_hot(self, hot_key: Hashable, args: tuple[Any, ...]) -> Any:
        """Call the plan filed under ``hot_key`` in the hot dict with ``args``; :data:`MISS` when there is none.

        ``hot_key`` is an op's *exact* key of a call: every input fact its checks and its cache key depend on
        (exact shapes instead of buckets), so a hit proves that a call with these facts was checked and
        looked up before, and the op skips both (:meth:`run` files such keys). Trace counts and kernel failures
        are handled as in :meth:`run`."""
        plan = self.cache.hot.get(hot_key)
        if plan is None:
            return MISS
        if TELEMETRY.on:
            return self._observed(plan, args)
        t = _TRACE.get()
        if t is not None:
            t.counts[(plan.op, plan.kernel_id)] += 1
        try:
            return plan.call(*args)
        except Exception as exc:  # noqa: BLE001 - every kernel failure is recorded, then re-raised or retried
            return self._on_failure(plan, exc, args, t)

    def hot_failure(self, plan: ExecutionPlan, exc: Exception, args: tuple[Any, ...]) -> Any:
        """What :meth:`run_hot` does when the plan raised, for the ops that call a hot plan themselves while
        :data:`~layerzero.core.observers.OBSERVERS` has none (so no trace to record in): retry on the next eligible
        kernels, or re-raise for a locked plan / strict mode (:meth:`_on_failure`)."""
        return self._on_failure(plan, exc, args, None)

    def _observed(self, plan: ExecutionPlan, args: tuple[Any, ...]) -> Any:
        """A hot-path call while telemetry is on: traced and counted as usual, every ``sample_every``-th call of
        a kernel timed (host time)."""
        t = _TRACE.get()
        if t is not None:
            t.counts[(plan.op, plan.kernel_id)] += 1
        try:
            if not TELEMETRY.count_call(plan.op, plan.kernel_id):
                return plan.call(*args)
            t0 = time.perf_counter()
            out = plan.call(*args)
            TELEMETRY.observe(plan.kernel_id, time.perf_counter() - t0)
            return out
        except Exception as exc:  # noqa: BLE001 - every kernel failure is recorded, then re-raised or retried
            return self._on_failure(plan, exc, args, t)

    def _run_slow(self, key: Hashable, build_ctx: ContextBuilder, args: tuple[Any, ...],
                  hot_key: Hashable | None = None) -> Any:
        """:meth:`run` through the sharded cache: select on a miss (then prepare the capture-time choice of a
        CUDA key, :meth:`prepare_capture`; also on the first run of a plan that ``lz.select`` / ``lz.which`` cached
        without running it, until 2026-11-25 a capture after ``lz.which`` then one eager call raised
        ``CudaGraphUnsafeError``), re-select a plan whose health re-check is due, count a probation
        success; promote a plain hit (and ``hot_key``) to the hot dict (only plans without ``recheck_at`` and
        ``trial``: the hot paths rely on that). A plain-tuple key becomes the op's named key first
        (:meth:`named_key`)."""
        if key.__class__ is tuple:
            key = self.named_key(key)
        hot = self.cache.hot
        plan = self.cache.get(key)
        miss = plan is None or plan.recheck_at is not None and plan.recheck_at <= time.monotonic()
        if miss:
            if plan is None and self.autotuner is not None and _config.get_config().autotune:
                self._autotune(key, build_ctx, args)
            plan = self.resolve(key, build_ctx, refresh=plan is not None)
        elif plan.recheck_at is None and not plan.trial:
            self.cache.promote(hot, key, plan)
            if hot_key is not None:
                self.cache.promote(hot, hot_key, plan)
        t = _TRACE.get()
        if t is not None:
            t.counts[(plan.op, plan.kernel_id)] += 1
        timed = TELEMETRY.on and TELEMETRY.count_call(plan.op, plan.kernel_id)
        try:
            t0 = time.perf_counter() if timed else 0.0
            out = plan.call(*args)
        except Exception as exc:  # noqa: BLE001 - every kernel failure is recorded, then re-raised or retried
            return self._on_failure(plan, exc, args, t)
        if timed:
            TELEMETRY.observe(plan.kernel_id, time.perf_counter() - t0)
        if plan.trial:
            self.health.record_success(plan.backend)
        if miss:
            if _config.get_config().canaries:
                out = probe_first_call(self, key, build_ctx, args, plan, out)
            self.prepare_capture(key, build_ctx, args, plan)
        elif hot.get(key) is plan:  # just promoted: the first call after lz.select / lz.which cached the plan
            self.prepare_capture(key, build_ctx, args, plan)
        return out

    def _named(self, key: Hashable) -> Hashable:
        """``key`` in its named form. Every internal entry point names its key again: under ``torch.compile``,
        TorchDynamo rebuilds a NamedTuple local as a plain tuple when it resumes a frame after a graph break (seen
        on CUDA with torch 2.11: the attention key reached its context builder as a tuple)."""
        return self.named_key(key) if key.__class__ is tuple else key

    def named_key(self, key: tuple[Any, ...]) -> Hashable:
        """The op's named key (:attr:`OperationSpec.key_type`) of ``key``, the plain-tuple form an op's hot path
        builds (its first field is the op id); ``key`` itself for any other key."""
        self.ensure_ready()
        op = key[0] if key else None
        if op.__class__ is str and op in self.registry.ops:
            key_type = self.registry.ops.get(op).key_type
            if key_type is not None:
                return key_type(*key)  # the constructor (TorchDynamo mis-traces tuple.__new__ of a NamedTuple)
        return key

    def _autotune(self, key: Hashable, build_ctx: ContextBuilder, args: tuple[Any, ...]) -> None:
        """Measure ``key``'s eligible kernels into the PerfDB before its first selection (never under capture);
        a failure of the autotuner itself is logged and selection goes on without it."""
        key = self._named(key)
        ctx = build_ctx(key)
        if ctx.graph_capture or self.autotuner is None:
            return
        try:
            self.autotuner(self, ctx, args)
        except Exception as exc:  # noqa: BLE001 - autotune is an optimization: never fail the call for it
            log.warning("LayerZero %s: autotune failed (%s: %s); selecting without it", ctx.op, type(exc).__name__,
                        exc)

    def _prepare_variants(self, cap: Hashable, build_ctx: ContextBuilder) -> None:
        """Cache the choices of the op's ``capture_variants`` of ``cap`` (selection only: no run, so no JIT warm-up;
        kernels that serve such variants under capture are torch's own); a variant no kernel can serve is left
        out (its capture then raises with the reasons)."""
        spec = self.registry.ops.get(build_ctx(cap).op)
        if spec.capture_variants is None:
            return
        for variant in spec.capture_variants(cap):
            if self.cache.get(variant) is None:
                vctx = build_ctx(variant)
                try:
                    self.cache.get_or_compute(variant,
                                              lambda c=vctx, v=variant: self.select_cached(v, c, quiet=True)[0],
                                              timeout_s=_config.get_config().selection_timeout_s)
                except NoKernelFoundError:
                    continue

    def prepare_capture(self, key: Hashable, build_ctx: ContextBuilder, args: tuple[Any, ...],
                        eager: ExecutionPlan | None = None) -> ExecutionPlan | None:
        """Select and cache the plan a call with ``key`` gets while a CUDA graph is being captured (graph-safe
        kernels only), and run it once now, outside any capture, when it differs from ``eager`` (the kernel
        that just ran), so any JIT/compile or plan allocation of that kernel happens here. Random-number state
        (torch.Generator arguments, the device's default CUDA generator) is restored afterwards, so the
        extra run draws nothing the caller would see. No-op for non-CUDA keys, keys already captured, or
        keys that are not op keys with a ``capture`` field.

        Returns the capture-time plan, or None (not CUDA, or no graph-safe kernel: logged at INFO; a capture
        of such a call raises ``CudaGraphUnsafeError`` with the reasons)."""
        key = self._named(key)
        cap = capture_key(key)
        if cap is None or cap == key:
            return None
        ctx = build_ctx(cap)
        if ctx.device.device_type != "cuda":
            return None
        plan = self.cache.get(cap)
        if plan is not None:
            return plan
        self._prepare_variants(cap, build_ctx)
        try:
            plan = self.cache.get_or_compute(cap, lambda: self.select_cached(cap, ctx, quiet=True)[0],
                                             timeout_s=_config.get_config().selection_timeout_s)
        except NoKernelFoundError as exc:
            log.info("LayerZero %s: no graph-safe kernel for these inputs, so this call cannot be captured in a "
                     "CUDA graph (%s)", ctx.op, str(exc).splitlines()[0])
            return None
        if eager is None or plan.kernel_id != eager.kernel_id:
            with rng_kept(args, ctx):
                try:
                    plan.call(*args)
                except Exception as exc:  # noqa: BLE001 - logged; a capture then retries graph-safe fallbacks
                    log.warning("LayerZero %s: warm-up run of the capture-time kernel %s failed (%s: %s)", ctx.op,
                                plan.kernel_id, type(exc).__name__, exc)
        return plan

    def _on_failure(self, plan: ExecutionPlan, exc: Exception, args: tuple[Any, ...],
                    t: DispatchTrace | None) -> Any:
        """Retry a failed call on the next eligible kernels.

        A backend's health counter is charged only when another kernel then succeeds on the same inputs:
        that proves the kernel, not the data (NaN logits, say), was at fault. When every kernel fails the
        inputs are to blame, no backend is charged, and ``KernelExecutionError`` lists every error.
        """
        if isinstance(exc, LayerZeroError) and not getattr(exc, "kernel_failure", False):
            raise exc  # LayerZero's own errors pass through; a kernel_failure one (a dead isolated worker) is retried
        failed = [(plan, exc)]
        if plan.locked or _config.get_config().strict or not plan.fallbacks:
            why = ("it is locked" if plan.locked else "strict mode is on" if plan.fallbacks
                   else "kernel choices are synchronized across ranks (lz.distributed.sync_selection)"
                   if self.coordinator is not None else "no other kernel is eligible")
            raise KernelExecutionError(
                f"kernel {plan.kernel_id} failed for op {plan.op!r} and no fallback is tried because {why}: "
                f"{type(exc).__name__}: {exc}") from exc
        for nxt in plan.fallbacks:
            log.warning("LayerZero %s: kernel %s failed at run time (%s: %s); retrying with %s", plan.op,
                        failed[-1][0].kernel_id, type(failed[-1][1]).__name__, failed[-1][1], nxt.kernel_id)
            if t is not None:
                t.fallbacks.append((plan.op, failed[-1][0].kernel_id,
                                    f"{type(failed[-1][1]).__name__}: {failed[-1][1]}"))
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
            f"every eligible kernel failed for op {plan.op!r}, so the inputs are the likely cause (for example "
            f"NaN/inf values) and no backend was marked unhealthy: {errors}") from failed[-1][1]


def _graph_safe_hint(runtime: Runtime, ctx: SelectionContext) -> str:
    """Why no graph-safe kernel can run ``ctx``, when that is the case (for the capture-miss error)."""
    try:
        runtime.select_context(ctx)
    except NoKernelFoundError as exc:
        return f" Note: no graph-safe kernel can run these inputs at all: {str(exc).splitlines()[0]}"
    except LayerZeroError:
        return ""
    return ""


def device_fingerprint_parts(device: DeviceSpec) -> dict[str, str]:
    """PerfDB fingerprint parts of ``device`` (name, SM, driver, CUDA, torch versions)."""
    return {k: str(v) for k, v in device.fingerprint_parts().items()}
