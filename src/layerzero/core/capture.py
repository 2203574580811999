"""Capture-time keys, RNG state around the capture-time warm-up run, the "select as captured" switch of
:func:`layerzero.capture_selection`, and what a runtime prepares on a key's first eager call
(:class:`CapturePreparation`: the capture-time choice, and the opt-in autotune before the first selection)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from . import config as _config
from .cache import SelectionCache
from .context import ContextBuilder, SelectionContext
from .errors import NoKernelFoundError
from .registry import KernelRegistry
from .report import SelectionReport
from .specs import ExecutionPlan

__all__ = ["AS_CAPTURED", "CapturePreparation", "capture_key", "capturing_now", "rng_kept"]

log = logging.getLogger("layerzero.dispatch")

AS_CAPTURED: ContextVar[bool] = ContextVar("layerzero_as_captured", default=False)
"""True inside :func:`layerzero.capture_selection`: CUDA calls take the keys, hence the kernels, they would
get while a CUDA graph is captured, without capturing (read by ``ops._common.stream_capturing``)."""


def capturing_now() -> bool:
    """Whether a CUDA graph is really being captured on the current stream (not just selected as captured)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_key(key: Hashable) -> Hashable | None:
    """The cache key a call with ``key`` gets while a CUDA graph is being captured: the same key with its
    ``capture`` field True. Every op's key is a ``NamedTuple`` with that field (``layerzero.ops``); None for
    any other key."""
    fields = getattr(key, "_fields", None)
    if fields is None or "capture" not in fields:
        return None
    i = fields.index("capture")
    # the constructor, not _replace: TorchDynamo mis-traces NamedTuple._make/tuple.__new__ (a short tuple)
    return type(key)(*key[:i], True, *key[i + 1 :])  # type: ignore[index]


@contextlib.contextmanager
def rng_kept(args: tuple[Any, ...], ctx: SelectionContext) -> Iterator[None]:
    """Restore the state of every ``torch.Generator`` in ``args`` and of the CUDA device's default
    generator."""
    gens = [a for a in args if isinstance(a, torch.Generator)]
    states = [g.get_state() for g in gens]
    index = ctx.device.index
    default = torch.cuda.get_rng_state(index) if index is not None and torch.cuda.is_available() else None
    try:
        yield
    finally:
        for g, st in zip(gens, states, strict=True):
            g.set_state(st)
        if default is not None:
            torch.cuda.set_rng_state(default, index)


class CapturePreparation:
    """What a runtime prepares on a key's first eager call, outside the hot path: the choice (and JIT warm-up)
    that the same call gets while a CUDA graph is captured (:meth:`prepare_capture`), and the opt-in
    measurement of a new key's kernels before its first selection (:meth:`_autotune`). A part of
    :class:`~layerzero.core.dispatch.Runtime` (a base class of it)."""

    # the Runtime's state (set in Runtime.__init__) and its other parts' methods used here
    registry: KernelRegistry
    cache: SelectionCache[ExecutionPlan]
    autotuner: Callable[[Any, SelectionContext, tuple[Any, ...]], None] | None
    _named: Callable[[Hashable], Hashable]
    select_cached: Callable[..., tuple[ExecutionPlan, SelectionReport]]

    def _autotune(self, key: Hashable, build_ctx: ContextBuilder, args: tuple[Any, ...]) -> None:
        """Measure ``key``'s eligible kernels into the PerfDB before its first selection (never under
        capture); a failure of the autotuner itself is logged and selection goes on without it."""
        key = self._named(key)
        ctx = build_ctx(key)
        if ctx.graph_capture or self.autotuner is None:
            return
        try:
            self.autotuner(self, ctx, args)
        except Exception as exc:  # noqa: BLE001 - autotune is an optimization: never fail the call for it
            log.warning(
                "LayerZero %s: autotune failed (%s: %s); selecting without it",
                ctx.op,
                type(exc).__name__,
                exc,
            )

    def _prepare_variants(self, cap: Hashable, build_ctx: ContextBuilder) -> None:
        """Cache the choices of the op's ``capture_variants`` of ``cap`` (selection only: no run, so no JIT
        warm-up; kernels that serve such variants under capture are torch's own); a variant no kernel can
        serve is left out (its capture then raises with the reasons)."""
        spec = self.registry.ops.get(build_ctx(cap).op)
        if spec.capture_variants is None:
            return
        for variant in spec.capture_variants(cap):
            if self.cache.get(variant) is None:
                vctx = build_ctx(variant)
                try:
                    self.cache.get_or_compute(
                        variant,
                        lambda c=vctx, v=variant: self.select_cached(v, c, quiet=True)[0],
                        timeout_s=_config.get_config().selection_timeout_s,
                    )
                except NoKernelFoundError:
                    continue

    def prepare_capture(
        self,
        key: Hashable,
        build_ctx: ContextBuilder,
        args: tuple[Any, ...],
        eager: ExecutionPlan | None = None,
    ) -> ExecutionPlan | None:
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
            plan = self.cache.get_or_compute(
                cap,
                lambda: self.select_cached(cap, ctx, quiet=True)[0],
                timeout_s=_config.get_config().selection_timeout_s,
            )
        except NoKernelFoundError as exc:
            log.info(
                "LayerZero %s: no graph-safe kernel for these inputs, so this call cannot be captured "
                "in a CUDA graph (%s)",
                ctx.op,
                str(exc).splitlines()[0],
            )
            return None
        if eager is None or plan.kernel_id != eager.kernel_id:
            with rng_kept(args, ctx):
                try:
                    plan.call(*args)
                except Exception as exc:  # noqa: BLE001 - logged; a capture then retries graph-safe fallbacks
                    log.warning(
                        "LayerZero %s: warm-up run of the capture-time kernel %s failed (%s: %s)",
                        ctx.op,
                        plan.kernel_id,
                        type(exc).__name__,
                        exc,
                    )
        return plan
