"""``lz.warmup(manifest, *, timeout_s=None, background=False)``: warm a manifest, critical cases first.

Each case is selected, cached and run once (``Runtime.resolve`` + ``Runtime.run``, as ``lz.warmup(op, cases)``
does), so selection, PerfDB reads and JIT compiles happen now. Critical cases run synchronously first; the
rest run in the caller's thread, or with ``background=True`` in a daemon thread (the returned
:class:`WarmupHandle` has ``done()``, ``wait(timeout)``, ``results``, ``errors``).

``timeout_s``: each case's first call runs in a worker thread; when it is not done after ``timeout_s`` seconds
the kernel it is running is denied *for that key* (the key's cached plan is replaced by a selection without
that kernel; a later cache invalidation selects again), the fallback is warmed instead, and a WARNING names
the kernel and the timeout. Python cannot kill a thread: the slow compile goes on in its worker thread until
it ends.

Progress: tqdm when installed, else one INFO log line per case. Warmed keys are remembered for
``lz.readiness_check`` (:data:`WARMED`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from layerzero.core import config as _config
from layerzero.core.policy import Policy
from layerzero.core.policy_schema import DenyRule
from layerzero.core.runtime import RUNTIME

from .manifest import Case, Manifest

log = logging.getLogger("layerzero.warmup")


@dataclass
class WarmedKey:
    """A warmed case: op, bucket, the cache key, its context builder, the kernel that ran, whether it ran."""

    op: str
    bucket: str
    key: Any
    build_ctx: Any
    kernel_id: str
    ran: bool
    device_type: str


WARMED: dict[Any, WarmedKey] = {}
"""Keys warmed by :func:`warmup_manifest` (key -> :class:`WarmedKey`); read by ``lz.readiness_check``."""
_WARMED_LOCK = threading.Lock()


@dataclass
class CaseResult:
    """What happened to one case: ``index`` (in the manifest), ``op``, ``kernel_id`` that now serves it,
    ``skipped`` (the kernel denied after its timeout, or None), ``reason`` (why it was skipped)."""

    index: int
    op: str
    kernel_id: str | None
    critical: bool
    skipped: str | None = None
    reason: str | None = None


@dataclass
class WarmupHandle:
    """Result of a manifest warm-up. ``results`` / ``errors`` (``(index, exception)``) fill in as cases
    finish; ``order``: manifest indices in the order they were warmed."""

    results: list[CaseResult] = field(default_factory=list)
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def done(self) -> bool:
        """True once every case was warmed (or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` seconds passed; returns :meth:`done`."""
        return self._done.wait(timeout)


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]

        return tqdm(total=total, desc=desc, leave=False)
    except ImportError:
        return None


def _deny_for_key(key: Any, build_ctx: Any, slow: Any) -> str:
    """Replace ``key``'s cached plan ``slow`` by a selection that excludes its kernel (in the sharded cache
    and wherever the hot dict holds ``slow``, e.g. an exact key filed next to ``key``); the new kernel id."""
    ctx = build_ctx(key)
    layer = Policy(deny=(DenyRule(ctx.op, (slow.kernel_id,)),), source="lz.warmup timeout")
    with _config.scoped_policy(layer):
        plan, _ = RUNTIME.select_context(ctx, quiet=True)
    cache = RUNTIME.cache
    cache.put(key, plan)
    hot = cache.hot
    for k in [k for k, v in list(hot.items()) if v is slow or k == key]:
        cache.promote(hot, k, plan)
    return plan.kernel_id


def _warm_one(i: int, case: Case, timeout_s: float | None, handle: WarmupHandle) -> None:
    from layerzero.api import _op
    from layerzero.core.arguments import check_call

    prepare, build_ctx = _op(case.op, f"lz.warmup manifest case {i}(op)")
    check_call(f"lz.warmup manifest case {i}", case.op, prepare, case.args, case.kwargs)
    key, call_args = prepare(*case.args, **case.kwargs)
    key = RUNTIME.named_key(key) if key.__class__ is tuple else key
    plan = RUNTIME.resolve(key, build_ctx)
    ctx = build_ctx(key)
    box: dict[str, Any] = {}

    def first_call() -> None:
        try:
            RUNTIME.run(key, build_ctx, call_args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    skipped = reason = None
    if timeout_s is None:
        first_call()
    else:
        worker = threading.Thread(target=first_call, name=f"lz-warmup-{case.op}-{i}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            skipped = plan.kernel_id
            new = _deny_for_key(key, build_ctx, plan)
            reason = (
                f"kernel {plan.kernel_id} did not finish its first call (JIT/compile) within timeout_s="
                f"{timeout_s:g} s; using {new} for this key (the slow call continues in a background thread)"
            )
            log.warning("LayerZero warmup %s case %d: %s", case.op, i, reason)
            plan = RUNTIME.resolve(key, build_ctx)
            box.clear()
            first_call()
    if "error" in box:
        raise box["error"]
    with _WARMED_LOCK:
        WARMED[key] = WarmedKey(
            case.op, ctx.bucket_key(), key, build_ctx, plan.kernel_id, True, ctx.device.device_type
        )
    handle.results.append(CaseResult(i, case.op, plan.kernel_id, case.critical, skipped, reason))


def _run_cases(
    items: list[tuple[int, Case]], timeout_s: float | None, handle: WarmupHandle, desc: str
) -> None:
    if not items:
        return
    bar = _progress(len(items), desc)
    for n, (i, case) in enumerate(items):
        handle.order.append(i)
        try:
            _warm_one(i, case, timeout_s, handle)
        except Exception as exc:  # noqa: BLE001 - one bad case does not stop the others; see handle.errors
            log.warning("LayerZero warmup %s case %d failed: %s: %s", case.op, i, type(exc).__name__, exc)
            handle.errors.append((i, exc))
        if bar is not None:
            bar.update(1)
        else:
            log.info("LayerZero warmup %s: %d/%d (%s)", desc, n + 1, len(items), case.op)
    if bar is not None:
        bar.close()


def warmup_manifest(
    manifest: Any, *, timeout_s: float | None = None, background: bool = False
) -> WarmupHandle:
    """Warm ``manifest`` (see the module docstring). Returns a :class:`WarmupHandle` (done unless
    ``background``).

    Raises:
        ManifestError: malformed manifest. InvalidInputError: ``timeout_s`` not None or a number > 0.
        Errors of single cases are collected in ``handle.errors`` (and logged), not raised.
    """
    from layerzero.core.errors import InvalidInputError, expected_got

    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
    ):
        raise InvalidInputError(expected_got("lz.warmup(timeout_s)", "None or a number > 0", repr(timeout_s)))
    m = Manifest.of(manifest, "lz.warmup(manifest)")
    RUNTIME.ensure_ready()
    indexed = list(enumerate(m.cases))
    critical = [(i, c) for i, c in indexed if c.critical]
    rest = [(i, c) for i, c in indexed if not c.critical]
    handle = WarmupHandle()
    _run_cases(critical, timeout_s, handle, "warmup (critical)")
    if background and rest:

        def work() -> None:
            try:
                _run_cases(rest, timeout_s, handle, "warmup (background)")
            finally:
                handle._done.set()

        handle._thread = threading.Thread(target=work, name="lz-warmup-background", daemon=True)
        handle._thread.start()
        return handle
    _run_cases(rest, timeout_s, handle, "warmup")
    handle._done.set()
    return handle


__all__ = ["WARMED", "CaseResult", "WarmedKey", "WarmupHandle", "warmup_manifest"]
