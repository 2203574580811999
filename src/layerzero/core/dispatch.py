"""Dispatch: the hot path from a cache key to a kernel call; :class:`Runtime`, the facade that holds it all.

A call's key (built by ``layerzero.ops``) is looked up in the sharded :class:`SelectionCache`. A hit
returns an :class:`ExecutionPlan` and calls it: a dict lookup, one observer check and the kernel call.
A miss builds the :class:`SelectionContext` *from the key*, runs :func:`selection.select` (single-flight
per key) and caches the plan. If the kernel raises, its backend's health counter records it and the call is
retried on the next eligible kernel (never for a lock; strict mode raises instead).

:class:`Runtime` is put together from one part per concern: :class:`~layerzero.core.stores.MeasurementStores`
(PerfDB, quarantine store, measurement terms), :class:`~layerzero.core.selection_runtime.RuntimeSelection`
(context -> plan, key -> cached plan), :class:`~layerzero.core.capture.CapturePreparation` (first-call
capture-time choice, autotune) and :class:`~layerzero.core.fallback.RuntimeFallback` (kernel failures). This
module keeps the set-up and the hot path, so a cache hit runs no code outside it.

The backends are not imported here (``core`` imports nothing above it, not even by a module-name string):
the package above installs a ``loader`` that registers them on first use (:meth:`Runtime.install_hooks`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from . import config as _config
from .cache import SelectionCache
from .capture import CapturePreparation
from .capture import capture_key as capture_key  # re-exported (its home is core/capture.py)
from .context import ContextBuilder as ContextBuilder  # re-exported (its home is core/context.py)
from .context import SelectionContext
from .device import DeviceSpec, device_free_bytes
from .errors import ConfigurationError
from .fallback import RuntimeFallback
from .health import BreakerState, HealthTracker
from .observers import OBSERVERS, TRACE, DispatchTrace
from .observers import trace as trace  # re-exported: lz.trace (its home is core/observers.py)
from .quarantine import probe_first_call
from .registry import KernelRegistry
from .report import SelectionReport
from .selection_runtime import RuntimeSelection
from .specs import ExecutionPlan
from .stores import MeasurementStores
from .stores import device_fingerprint_parts as device_fingerprint_parts  # re-exported (home: core/stores.py)
from .telemetry import TELEMETRY

__all__ = [
    "MISS",
    "ContextBuilder",
    "DispatchTrace",
    "Runtime",
    "SelectionCoordinator",
    "call_traced",
    "capture_key",
    "device_fingerprint_parts",
    "trace",
]

log = logging.getLogger("layerzero.dispatch")

Loader = Callable[[KernelRegistry], None]
"""Registers the built-in op specs and backends in a registry (``layerzero.ops.register_builtin``)."""
Autotuner = Callable[["Runtime", SelectionContext, tuple[Any, ...]], None]
"""Measures a new key's kernels into the PerfDB before its first selection (``layerzero.tuning.autotune``)."""
Canary = Callable[["Runtime", SelectionContext, tuple[Any, ...], Any], str | None]
"""Checks a new key's first output against the reference: None when it agrees, else why not."""

MISS = object()
"""What :meth:`Runtime.run_hot` returns when its key is not in the hot dict (no kernel returns this
object)."""


def call_traced(plan: ExecutionPlan, args: tuple[Any, ...], t: DispatchTrace | None) -> Any:
    """Call ``plan`` with ``args`` as dispatch does while something observes it: counted in the ``lz.trace()``
    block ``t`` (None: no block), and, while telemetry records, counted there with every ``sample_every``-th
    call of a kernel timed (host time). Raises what the kernel raises (the caller hands it to
    ``Runtime._on_failure``). The one place of this logic: :meth:`Runtime.run` and :meth:`Runtime.run_hot`
    while observed, and every call on the slow path, use it. An unobserved hit (``OBSERVERS.none``) calls
    ``plan.call`` directly instead, which is all this would do then, without this frame."""
    if t is not None:
        t.counts[(plan.op, plan.kernel_id)] += 1
    if TELEMETRY.on and TELEMETRY.count_call(plan.op, plan.kernel_id):
        t0 = time.perf_counter()
        out = plan.call(*args)
        TELEMETRY.observe(plan.kernel_id, time.perf_counter() - t0)
        return out
    return plan.call(*args)


class SelectionCoordinator(Protocol):
    """Decides the plans that go into the selection cache in place of :meth:`Runtime.select_context` while it
    is set as :attr:`Runtime.coordinator` (``layerzero.distributed.sync_selection``: rank 0's choice on every
    rank). Called on cache misses only (never on a hit), with the op's named ``key`` and its context."""

    def select(
        self, runtime: Runtime, key: Hashable, ctx: SelectionContext, quiet: bool
    ) -> tuple[ExecutionPlan, SelectionReport]: ...

    def explain(self, runtime: Runtime, key: Hashable, ctx: SelectionContext) -> SelectionReport:
        """``lz.explain``'s report for ``key`` in this mode (must not communicate)."""
        ...


class Runtime(MeasurementStores, RuntimeSelection, CapturePreparation, RuntimeFallback):
    """Holds the registry, selection cache, health tracker and PerfDB; runs selections and calls.

    Cheap to construct (no I/O): the environment, backends and PerfDB are loaded on the first miss, by the
    ``loader`` given here or later to :meth:`install_hooks` (the package root installs
    ``layerzero.ops.register_builtin``; see ``layerzero/_wiring.py``).
    """

    def __init__(
        self, loader: Loader | None = None, autotuner: Autotuner | None = None, canary: Canary | None = None
    ) -> None:
        self._loader = loader
        self.canary = canary
        """Called as ``canary(runtime, ctx, args, out)`` on a new key's first call with
        ``lz.configure(canaries=True)``: None when ``out`` agrees with the reference, else why not
        (``core/quarantine.py``)."""
        self.coordinator: SelectionCoordinator | None = None
        """When set, the plans of cache misses (eager and capture-time keys) come from ``coordinator.select``
        instead of :meth:`select_context`; ``layerzero.distributed.sync_selection`` sets it. None: local
        choice."""
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
        self._init_stores()

    # ------------------------------------------------------------------ set-up
    def install_hooks(
        self,
        *,
        loader: Loader | None = None,
        autotuner: Autotuner | None = None,
        canary: Canary | None = None,
    ) -> None:
        """Install what ``core`` cannot name itself, from the package above it: the ``loader`` that registers
        the built-in op specs and backends on first use, the online ``autotuner`` and the ``canary`` check
        (each left as it was when not given). ``layerzero/_wiring.py`` calls this when ``layerzero`` is
        imported. A loader installed after the runtime loaded its registry is not run again. Raises
        nothing."""
        if loader is not None:
            self._loader = loader
        if autotuner is not None:
            self.autotuner = autotuner
        if canary is not None:
            self.canary = canary

    def ensure_ready(self) -> None:
        """Load env config and register the built-in backends, once.

        Raises:
            ConfigurationError: no loader is installed (``core`` used before the package wired it).
        """
        if self._ready:
            return
        with self._init_lock:
            if self._ready:
                return
            loader = self._loader
            if loader is None:
                raise ConfigurationError(
                    "LayerZero's dispatch runtime has no backend loader, so it cannot register any op or "
                    "kernel: expected one installed with Runtime.install_hooks(loader=...) before the first "
                    "selection. Importing the package (`import layerzero`) installs the built-in one: "
                    "import it before using its core modules directly, or install a loader yourself."
                )
            _config.ensure_env_loaded()
            loader(self.registry)
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
        """Rebuild the selection cache / health tracker when their configured sizes or thresholds changed."""
        if self._cache_shape != (cfg.cache_size, cfg.cache_ttl_s):
            self.cache = SelectionCache(max_entries=cfg.cache_size, ttl_s=cfg.cache_ttl_s)
            self._cache_shape = (cfg.cache_size, cfg.cache_ttl_s)
        if (self.health.failure_threshold, self.health.cooldown_s) != (
            cfg.health_failure_threshold,
            cfg.health_cooldown_s,
        ):
            self.health = HealthTracker(
                cfg.health_failure_threshold, cfg.health_cooldown_s, on_change=self._on_health_change
            )

    def _on_config_change(self) -> None:
        """Config listener: apply the new config and drop every cached selection (O(1))."""
        self._apply_config(_config.get_config())
        self.cache.invalidate()

    def _on_health_change(self, backend_id: str, state: BreakerState) -> None:
        """Health listener: log a breaker change, count a trip in telemetry, and bump the config epoch."""
        log.warning("LayerZero backend %s circuit breaker is now %s", backend_id, state.value)
        if TELEMETRY.on and state is BreakerState.OPEN:
            TELEMETRY.health_trips[backend_id] += 1
        _config.notify_change()

    # ------------------------------------------------------------------ the hot path
    def run(
        self, key: Hashable, build_ctx: ContextBuilder, args: tuple[Any, ...], hot_key: Hashable | None = None
    ) -> Any:
        """Look ``key`` up, select on a miss, and call the plan with ``args`` (the op's canonical arguments).

        The hot path is one dict lookup (``SelectionCache.hot``) and the kernel call; anything else (a miss, a
        plan under health re-check or on probation: such plans never enter the hot dict, see
        :meth:`_run_slow`) takes :meth:`_run_slow`. ``key`` may be the plain-tuple form of the op's named key
        (:attr:`OperationSpec.key_type`). ``hot_key``: the op's exact key of this call for :meth:`run_hot`,
        filed in the hot dict next to ``key`` whenever ``key``'s plan is."""
        hot = self.cache.hot
        plan = hot.get(key)
        if plan is None:
            return self._run_slow(key, build_ctx, args, hot_key)
        if hot_key is not None:
            self.cache.promote(hot, hot_key, plan)
        if OBSERVERS.none:  # nobody counts, times or records this call (core/observers.py)
            try:
                return plan.call(*args)
            except Exception as exc:  # noqa: BLE001 - every kernel failure: recorded, re-raised or retried
                return self._on_failure(plan, exc, args, None)
        t = TRACE.get()
        try:
            return call_traced(plan, args, t)
        except Exception as exc:  # noqa: BLE001 - every kernel failure: recorded, re-raised or retried
            return self._on_failure(plan, exc, args, t)

    def run_hot(self, hot_key: Hashable, args: tuple[Any, ...]) -> Any:
        """Call the plan filed under ``hot_key`` in the hot dict with ``args``; :data:`MISS` when there is
        none.

        ``hot_key`` is an op's *exact* key of a call: every input fact its checks and its cache key depend on
        (exact shapes instead of buckets), so a hit proves that a call with these facts was checked and looked
        up before, and the op skips both (:meth:`run` files such keys). Trace counts and kernel failures are
        handled as in :meth:`run`."""
        plan = self.cache.hot.get(hot_key)
        if plan is None:
            return MISS
        if OBSERVERS.none:  # nobody counts, times or records this call (core/observers.py)
            try:
                return plan.call(*args)
            except Exception as exc:  # noqa: BLE001 - every kernel failure: recorded, re-raised or retried
                return self._on_failure(plan, exc, args, None)
        t = TRACE.get()
        try:
            return call_traced(plan, args, t)
        except Exception as exc:  # noqa: BLE001 - every kernel failure: recorded, re-raised or retried
            return self._on_failure(plan, exc, args, t)

    def hot_failure(self, plan: ExecutionPlan, exc: Exception, args: tuple[Any, ...]) -> Any:
        """What :meth:`run_hot` does when the plan raised, for the ops that call a hot plan themselves while
        :data:`~layerzero.core.observers.OBSERVERS` has none (so no trace to record in): retry on the next
        eligible kernels, or re-raise for a locked plan / strict mode (:meth:`_on_failure`)."""
        return self._on_failure(plan, exc, args, None)

    def _run_slow(
        self, key: Hashable, build_ctx: ContextBuilder, args: tuple[Any, ...], hot_key: Hashable | None = None
    ) -> Any:
        """:meth:`run` through the sharded cache: select on a miss (then prepare the capture-time choice of a
        CUDA key, :meth:`prepare_capture`; also on the first run of a plan that ``lz.select`` / ``lz.which``
        cached without running it, so that a capture after ``lz.which`` and one eager call does not raise
        ``CudaGraphUnsafeError``; benchmarks/results/history.md), re-select a plan whose health re-check is
        due, count a probation success; promote a plain hit (and ``hot_key``) to the hot dict (only plans
        without ``recheck_at`` and ``trial``: the hot paths rely on that). A plain-tuple key becomes the op's
        named key first (:meth:`named_key`)."""
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
        t = TRACE.get()
        try:
            out = call_traced(plan, args, t)
        except Exception as exc:  # noqa: BLE001 - every kernel failure is recorded, then re-raised or retried
            return self._on_failure(plan, exc, args, t)
        if plan.trial:
            self.health.record_success(plan.backend)
        if miss:
            if _config.get_config().canaries:
                out = probe_first_call(self, key, build_ctx, args, plan, out)
            self.prepare_capture(key, build_ctx, args, plan)
        elif hot.get(key) is plan:  # just promoted: the first call after lz.select / lz.which cached the plan
            self.prepare_capture(key, build_ctx, args, plan)
        return out
