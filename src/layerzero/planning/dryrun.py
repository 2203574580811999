"""``lz.dry_run(fn, *example_inputs)``: what would run where, without running any kernel.

Inside the dry run every ``lz`` op call is *recorded* instead of executed: the op checks its inputs and builds
its key as usual, then the runtime selects (through the compiled table or the distributed coordinator when one
is set, without filling the selection cache) and records ``(op, shapes, kernel, why)``. The op's output is
shaped by running the op's *reference* kernel on ``torch.device("meta")`` copies of the arguments (no data, no
compute) and returned as zeros of that shape on the inputs' device, so the function can go on. Only when the
reference cannot run on meta tensors is the chosen kernel run on the real inputs (the row says ``ran=True``).

Calls through the public ``lz.<op>`` attribute (or ``layerzero.ops.<op>``, what the integrations call) also go
into :attr:`DryRunReport.manifest` (the user-level ``(op, args, kwargs)``: a manifest derived from a model and
example inputs). Only this thread's calls are recorded (a context variable); other threads are served normally
while a dry run is in progress.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from layerzero.core.errors import NoKernelFoundError
from layerzero.core.observers import OBSERVERS
from layerzero.core.runtime import RUNTIME

from .manifest import Case, Manifest, _summ
from .solve import _why


@dataclass(frozen=True)
class DryRunRow:
    """One recorded call: ``op``, ``shapes`` (argument summary), ``kernel`` (None: no kernel can run it),
    ``why`` (score summary and notes, or the error), ``bucket`` and ``ran`` (True only when the kernel had to
    run)."""

    op: str
    shapes: str
    kernel: str | None
    why: str
    bucket: str
    ran: bool = False


@dataclass
class DryRunReport:
    """Rows in call order and the derived :class:`Manifest`; ``str()`` is a table, ``kernels()`` a set."""

    rows: list[DryRunRow] = field(default_factory=list)
    manifest: Manifest = field(default_factory=Manifest)

    def kernels(self) -> set[tuple[str, str | None]]:
        """``{(op, kernel)}`` of the rows."""
        return {(r.op, r.kernel) for r in self.rows}

    def to_dict(self) -> dict[str, Any]:
        """JSON form: rows and the manifest's spec form."""
        return {"rows": [r.__dict__ for r in self.rows], "manifest": self.manifest.to_dict()}

    def __str__(self) -> str:
        rows = [
            ("op", "shapes", "kernel", "why"),
            *((r.op, r.shapes, r.kernel or "-", r.why + (" [ran]" if r.ran else "")) for r in self.rows),
        ]
        w = [min(70, max(len(r[i]) for r in rows)) for i in range(4)]
        return "\n".join("  ".join(c[:90].ljust(x) for c, x in zip(r, w, strict=True)).rstrip() for r in rows)


_ACTIVE: contextvars.ContextVar[DryRunReport | None] = contextvars.ContextVar(
    "layerzero_dry_run", default=None
)
_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = [0]
_SAVED: dict[tuple[Any, str], Any] = {}


def _meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.empty_like(v, device="meta")
    if isinstance(v, (tuple, list)):
        return type(v)(_meta(x) for x in v)
    return v


def _real(v: Any, device: torch.device) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.zeros(v.shape, dtype=v.dtype, device=device)
    if isinstance(v, (tuple, list)):
        return type(v)(_real(x, device) for x in v)
    return v


def _device_of(args: tuple[Any, ...]) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _record_run(rep: DryRunReport, key: Any, build_ctx: Any, args: tuple[Any, ...]) -> Any:
    named = RUNTIME.named_key(key) if key.__class__ is tuple else key
    ctx = build_ctx(named)
    shapes = ", ".join(_summ(a) for a in args if isinstance(a, torch.Tensor))
    try:
        plan, report = RUNTIME.select_cached(named, ctx, quiet=True)
        kernel, why = plan.kernel_id, "; ".join((_why(report), *report.notes))
    except NoKernelFoundError as exc:
        plan, kernel, why = None, None, str(exc).splitlines()[0]
    reg = RUNTIME.registry
    ref = reg.kernel(reg.ops.get(ctx.op).reference_kernel, ctx.op)
    from layerzero.core.selection import bind

    ref_call = bind(reg, ref, ctx)[0]
    ran = False
    try:
        out = _real(ref_call(*_meta(args)), _device_of(args))
    except Exception:  # noqa: BLE001 - the reference cannot shape it on meta: run the real kernel instead
        if plan is None:
            raise
        out, ran = plan.call(*args), True
    rep.rows.append(DryRunRow(ctx.op, shapes, kernel, why, ctx.bucket_key(), ran))
    return out


class _Recorder:
    """Per-instance replacements of ``Runtime.run`` / ``run_hot`` that record in a dry run and delegate
    otherwise."""

    @staticmethod
    def run(key: Any, build_ctx: Any, args: tuple[Any, ...], hot_key: Any = None) -> Any:
        rep = _ACTIVE.get()
        if rep is None:
            return type(RUNTIME).run(RUNTIME, key, build_ctx, args, hot_key)
        return _record_run(rep, key, build_ctx, args)

    @staticmethod
    def run_hot(hot_key: Any, args: tuple[Any, ...]) -> Any:
        if _ACTIVE.get() is None:
            return type(RUNTIME).run_hot(RUNTIME, hot_key, args)
        from layerzero.core.dispatch import MISS

        return MISS  # the op then takes its full path and calls run()


def _op_wrapper(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        rep = _ACTIVE.get()
        if rep is not None:
            rep.manifest.cases.append(Case(name, tuple(args), dict(kwargs)))
        return fn(*args, **kwargs)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapped.__doc__, wrapped.__name__ = fn.__doc__, name
    return wrapped


def _public_namespaces() -> list[Any]:
    """The modules whose ``<op>`` attributes are the public op functions: the package root (``lz.<op>``; taken
    from ``sys.modules``, where it is whenever a submodule is, so that this module does not import the package
    above it) and :mod:`layerzero.ops` (what the integrations and the composite backend call)."""
    from layerzero import ops

    root = sys.modules.get("layerzero")
    return [ops] if root is None else [root, ops]


def _patch() -> None:
    from layerzero.ops import OPS

    with _PATCH_LOCK:
        _PATCH_DEPTH[0] += 1
        if _PATCH_DEPTH[0] > 1:
            return
        RUNTIME.run, RUNTIME.run_hot = _Recorder.run, _Recorder.run_hot  # type: ignore[method-assign]
        OBSERVERS.enter()  # the ops' inlined hot path would bypass the recorder
        for namespace in _public_namespaces():
            for name in OPS:
                fn = getattr(namespace, name, None)
                if callable(fn):
                    _SAVED[(namespace, name)] = fn
                    setattr(namespace, name, _op_wrapper(name, fn))


def _unpatch() -> None:
    with _PATCH_LOCK:
        _PATCH_DEPTH[0] -= 1
        if _PATCH_DEPTH[0] > 0:
            return
        del RUNTIME.run, RUNTIME.run_hot  # back to the class methods
        OBSERVERS.leave()
        for (namespace, name), fn in _SAVED.items():
            setattr(namespace, name, fn)
        _SAVED.clear()


def dry_run(model_or_fn: Callable[..., Any], *example_inputs: Any, **example_kwargs: Any) -> DryRunReport:
    """Call ``model_or_fn(*example_inputs, **example_kwargs)`` with every ``lz`` op recorded instead of run.

    Returns:
        A :class:`DryRunReport`: one row per op call (op, shapes, kernel, why) in call order, ``str()`` a
        table, and ``.manifest`` the calls made through ``lz.<op>`` (feed it to ``lz.solve`` / ``lz.warmup``).

    Raises:
        What ``model_or_fn`` raises (non-``lz`` torch code in it runs normally, on zeros returned by the ops),
        and the ops' ``InvalidInputError``; a call no kernel can run is a row with kernel ``None`` when the
        reference can shape it.
    """
    if not callable(model_or_fn):
        from layerzero.core.errors import ConfigurationError

        raise ConfigurationError(
            f"lz.dry_run(model_or_fn): expected a callable (a model or function), got "
            f"{type(model_or_fn).__name__}."
        )
    RUNTIME.ensure_ready()
    rep = DryRunReport()
    _patch()
    token = _ACTIVE.set(rep)
    try:
        with torch.no_grad():
            model_or_fn(*example_inputs, **example_kwargs)
    finally:
        _ACTIVE.reset(token)
        _unpatch()
    return rep


__all__ = ["DryRunReport", "DryRunRow", "dry_run"]
