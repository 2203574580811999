"""CUDA-graph helpers: ``lz.is_graph_safe``, ``lz.warmup``, ``lz.validate_graph_capture``.

The rules (docs/cuda_graphs.md): while a CUDA graph is being captured only graph-safe kernels are eligible
(``KernelSpec.graph_safe``; the shared filter rejects the others with ``CUDA_GRAPH_UNSAFE``) and no selection
work may happen (no PerfDB read, no JIT compile, no Python decision whose result the graph would freeze
without LayerZero knowing). Every op's cache key holds the capture flag, so a call under capture looks up its
own entry (``core.dispatch.capture_key``: the key with ``capture=True``); a miss there raises
``CudaGraphUnsafeError`` (``core/dispatch.py``) unless ``lz.configure(allow_selection_in_capture=True)``. The
first eager call of a CUDA key fills the capture entry too and runs its kernel once when it differs from the
eager one (``Runtime.prepare_capture``), so the ordinary PyTorch recipe (eager calls, side-stream warm-up,
capture) works; :func:`warmup` does the same for exact cases ahead of time.

The capture procedure follows the PyTorch CUDA-graphs notes ("CUDA Graphs", torch.cuda docs): warm up on a
side stream, capture with ``torch.cuda.graph``, replay, read the static outputs.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from layerzero.core import config as _config
from layerzero.core.arguments import check_call
from layerzero.core.capture import AS_CAPTURED
from layerzero.core.dispatch import trace
from layerzero.core.errors import (
    CudaGraphUnsafeError,
    InvalidInputError,
    NoKernelFoundError,
    UnknownOperationError,
    expected_got,
)
from layerzero.core.runtime import RUNTIME
from layerzero.ops import OPS

log = logging.getLogger("layerzero.graphs")

GRAPH_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
"""Default ``(rtol, atol)`` per output dtype for replay vs eager (other dtypes must be equal). A replay runs
the same kernels on the same inputs, so differences come only from non-deterministic kernels (atomics)."""


@dataclass(frozen=True, slots=True)
class GraphCheck:
    """Report of :func:`validate_graph_capture`.

    ``ok``: captured and every replay matched the eager output. ``max_error``: largest ``|replay - eager|``
    over all replays and outputs (float64; ``inf`` when the capture failed or shapes differ). ``replays``:
    replays compared. ``kernels``: ``"op:kernel_id"`` served during the capture (``lz.trace``). ``error``:
    what went wrong (None when ok).
    """

    ok: bool
    max_error: float
    replays: int
    kernels: tuple[str, ...]
    error: str | None = None

    def __str__(self) -> str:
        status = "ok" if self.ok else f"FAILED: {self.error}"
        return (
            f"CUDA graph check {status}; max |replay - eager| = {self.max_error:.3g} over {self.replays} "
            f"replays; kernels captured: {', '.join(self.kernels) or '-'}"
        )


def _op(op: Any) -> tuple[Any, Any]:
    try:
        return OPS[op]
    except (KeyError, TypeError):
        raise UnknownOperationError(f"unknown op {op!r}. Known ops: {sorted(OPS)}.") from None


@contextlib.contextmanager
def capture_selection(enabled: bool = True) -> Iterator[None]:
    """Inside the ``with`` block, calls on CUDA tensors select (and cache) exactly as they would while a CUDA
    graph is being captured, without capturing: graph-safe kernels only, each kernel scored with its
    ``capture_priority`` (device time counts, not launch cost), no PerfDB reads, the same cache entries a
    capture of the same calls uses. So an eager run computes what a captured graph of the same calls computes,
    kernel for kernel: an engine's eager decode (``enforce_eager``) and its CUDA-graph decode give the same
    tokens. Calls on other devices are unaffected; a real capture inside the block behaves as always. This
    thread / task only (a ``contextvars`` switch); nests.

    ``enabled=False``: eager selection inside the block, also within an enclosing ``capture_selection()``
    (the engine's piecewise graphs run each attention call eagerly between two captured pieces).

    Raises:
        Nothing of its own; inside, a call that no graph-safe kernel can run raises ``NoKernelFoundError`` (as
        its capture would).

    >>> import layerzero as lz
    >>> with lz.capture_selection():
    ...     pass
    """
    token = AS_CAPTURED.set(enabled)
    try:
        yield
    finally:
        AS_CAPTURED.reset(token)


def is_graph_safe(op: str, *args: Any, **kwargs: Any) -> bool:
    """Whether ``lz.<op>(*args, **kwargs)`` could run inside a CUDA-graph capture: True iff selection, for
    these inputs with ``graph_capture=True``, finds a graph-safe kernel (current policy and locks included).

    Works on any device (the inputs' context is evaluated as if captured), so it can be asked on CPU.

    Raises:
        UnknownOperationError: unknown ``op``. InvalidInputError: bad inputs (the op's own message), or
            arguments that do not bind to ``lz.<op>``'s signature (a misspelt keyword, a missing argument).
    """
    prepare, build_ctx = _op(op)
    check_call("lz.is_graph_safe", op, prepare, args, kwargs)
    key, _ = prepare(*args, **kwargs)
    ctx = replace(build_ctx(key), graph_capture=True)
    try:
        plan, _ = RUNTIME.select_context(ctx)
        chosen: str | None = plan.kernel_id
    except NoKernelFoundError as exc:  # nothing eligible, or strict mode refusing a fallback (still eligible)
        chosen = None if exc.report is None else exc.report.chosen
    return chosen is not None and RUNTIME.registry.kernel(chosen, op).graph_safe


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _case(op: str, i: int, case: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if (
        not isinstance(case, (tuple, list))
        or len(case) != 2
        or not isinstance(case[0], (tuple, list))
        or not isinstance(case[1], dict)
    ):
        raise InvalidInputError(
            expected_got(
                f"lz.warmup({op!r}) case {i}",
                "(args, kwargs): a tuple of positional arguments and a dict of keyword arguments",
                repr(case)[:120],
                "Write cases=[((q, k, v), {'is_causal': True}), ...].",
            )
        )
    return tuple(case[0]), case[1]


def warmup(
    op: Any, cases: Iterable[Any] | None = None, *, timeout_s: float | None = None, background: bool = False
) -> Any:
    """Select, cache and run ``lz.<op>`` once for each case, so every selection, PerfDB read and JIT/compile
    (e.g. ``torch.compile`` of ``flex_attention.compiled``) happens now rather than while serving or
    capturing.

    Manifest form: ``lz.warmup(manifest, timeout_s=None, background=False)`` with a
    :class:`layerzero.planning.Manifest` (or a list of ``(op, args, kwargs[, critical])``) warms critical
    cases first, the rest in a daemon thread when ``background``, skips a kernel whose first call exceeds
    ``timeout_s`` (its fallback is used) and returns a :class:`layerzero.planning.WarmupHandle`
    (:func:`layerzero.planning.warmup_manifest`, docs/planning.md).

    For CUDA inputs the capture-time cache entry is filled as well (graph-safe kernels only) and its kernel
    run once eagerly; an op with no graph-safe kernel for a case logs a WARNING (capturing it would raise).

    Args:
        op: op id (``"attention"``, ``"rms_norm"``, ...).
        cases: a list of ``(args, kwargs)``, exactly what ``lz.<op>(*args, **kwargs)`` takes (like
            ``lz.tune``).

    Returns:
        The kernel id chosen for each case (outside capture), in order.

    Raises:
        UnknownOperationError: unknown ``op``. InvalidInputError: a malformed case (including arguments that
            do not bind to ``lz.<op>``'s signature, e.g. a misspelt keyword; the message names the case index
            and the signature) or bad inputs.
        CudaGraphUnsafeError: called while a CUDA graph is being captured.
    """
    if not isinstance(op, str):
        from layerzero.planning.warmup import warmup_manifest

        if cases is not None:
            raise InvalidInputError(
                expected_got(
                    "lz.warmup(manifest, cases)",
                    "no cases with a manifest",
                    type(cases).__name__,
                    "Call lz.warmup(manifest) or lz.warmup(op, cases).",
                )
            )
        return warmup_manifest(op, timeout_s=timeout_s, background=background)
    if timeout_s is not None or background:
        raise InvalidInputError(
            expected_got(
                f"lz.warmup({op!r}, cases)",
                "timeout_s/background only with a manifest",
                f"timeout_s={timeout_s!r}, background={background!r}",
                "Build a layerzero.planning.Manifest to use them.",
            )
        )
    prepare, build_ctx = _op(op)
    if isinstance(cases, (dict, str)) or not isinstance(cases, Iterable):
        raise InvalidInputError(
            expected_got(
                f"lz.warmup({op!r}) cases",
                "a list of (args, kwargs)",
                type(cases).__name__,
                "Wrap a single case in a list: cases=[...].",
            )
        )
    if _capturing():
        raise CudaGraphUnsafeError(
            "lz.warmup cannot run while a CUDA graph is being captured: warm up before torch.cuda.graph(...)."
        )
    RUNTIME.ensure_ready()
    chosen: list[str] = []
    for i, case in enumerate(list(cases)):
        args, kwargs = _case(op, i, case)
        check_call(f"lz.warmup({op!r}) case {i}", op, prepare, args, kwargs)
        key, call_args = prepare(*args, **kwargs)
        plan = RUNTIME.resolve(key, build_ctx)
        RUNTIME.run(key, build_ctx, call_args)
        chosen.append(plan.kernel_id)
        if (
            build_ctx(key).device.device_type == "cuda"
            and RUNTIME.prepare_capture(key, build_ctx, call_args, plan) is None
        ):
            log.warning(
                "LayerZero warmup %s case %d: no graph-safe kernel for these inputs, so this call cannot be "
                "captured in a CUDA graph (lz.explain(..., with the call inside a capture) says why)",
                op,
                i,
            )
    return chosen


def _flatten(out: Any) -> list[Any]:
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _flatten(o)]
    return [out]


def _compare(out: Any, ref: Any, rtol: float | None, atol: float | None) -> tuple[float, str | None]:
    """``(max |out - ref|, None)`` when within tolerance, else ``(max error, message)``."""
    outs, refs = _flatten(out), _flatten(ref)
    if len(outs) != len(refs):
        return math.inf, expected_got("number of outputs", len(refs), len(outs))
    worst = 0.0
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if not isinstance(r, torch.Tensor):
            if o != r:
                return math.inf, expected_got(f"output {i}", repr(r), repr(o))
            continue
        if not isinstance(o, torch.Tensor) or o.shape != r.shape or o.dtype != r.dtype:
            return math.inf, expected_got(
                f"output {i}",
                f"{r.dtype} {tuple(r.shape)}",
                f"{getattr(o, 'dtype', type(o).__name__)} {tuple(getattr(o, 'shape', ()))}",
            )
        if not r.is_floating_point():
            if not torch.equal(o, r):
                return math.inf, f"output {i} ({r.dtype}) differs from the eager output"
            continue
        drt, dat = GRAPH_TOLERANCES.get(r.dtype, (1e-5, 1e-5))
        rt, at = drt if rtol is None else rtol, dat if atol is None else atol
        o64, r64 = o.to(torch.float64), r.to(torch.float64)
        err = (o64 - r64).abs()
        same_nan = torch.isnan(o64) & torch.isnan(r64)
        e = float(err.masked_fill(same_nan, 0).nan_to_num(math.inf).max()) if err.numel() else 0.0
        worst = max(worst, e)
        if not bool(((err <= at + rt * r64.abs()) | same_nan | (o64 == r64)).all()):
            return (
                worst,
                f"output {i}: max |replay - eager| = {e:.3g} exceeds atol {at:g} + rtol {rt:g} x |eager|",
            )
    return worst, None


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out


def validate_graph_capture(
    fn: Callable[..., Any], *args: Any, warmup: int = 2, rtol: float | None = None, atol: float | None = None
) -> GraphCheck:
    """Capture ``fn(*args)`` in a ``torch.cuda.CUDAGraph`` and check that replaying it reproduces eager
    results.

    Steps (PyTorch "CUDA Graphs" notes): run ``fn`` eagerly (the reference output), run it ``warmup`` more
    times on a side stream, capture one call with ``torch.cuda.graph`` inside ``lz.trace()`` (the kernels it
    used), replay twice and compare each replay's static output with the eager one (``rtol``/``atol``, default
    :data:`GRAPH_TOLERANCES` of each output dtype; integer outputs must be equal). ``fn`` must return a tensor
    or a (nested) tuple/list of tensors and read only ``args`` (static inputs) — allocate nothing it returns
    outside.

    Args:
        fn: the callable to capture, e.g. ``lambda q, k, v: lz.attention(q, k, v, is_causal=True)``.
        *args: its arguments (CUDA tensors; reused by every replay).
        warmup: eager side-stream runs before the capture, >= 0 (call :func:`warmup` for LayerZero's own
            caches).
        rtol, atol: tolerances overriding the per-dtype defaults.

    Returns:
        A :class:`GraphCheck`.

    Raises:
        CudaGraphUnsafeError: no CUDA device or no CUDA tensor among ``args``; in strict mode
            (``lz.configure(strict=True)``) also a capture error or a replay mismatch.
        InvalidInputError: ``warmup`` not an int >= 0, or negative/non-finite ``rtol``/``atol``.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InvalidInputError(
            expected_got("lz.validate_graph_capture(warmup)", "an int >= 0", repr(warmup))
        )
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if tol is not None and (
            isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0
        ):
            raise InvalidInputError(
                expected_got(f"lz.validate_graph_capture({name})", "None or a finite float >= 0", repr(tol))
            )
    tensors = [a for a in _flatten(list(args)) if isinstance(a, torch.Tensor)]
    if not torch.cuda.is_available() or not any(t.is_cuda for t in tensors):
        raise CudaGraphUnsafeError(
            expected_got(
                "lz.validate_graph_capture: CUDA graphs need a CUDA device",
                "CUDA tensors among the arguments",
                f"cuda available={torch.cuda.is_available()}, "
                f"devices={sorted({str(t.device) for t in tensors})}",
                "Run on a GPU with .cuda() inputs; on CPU there is nothing to capture.",
            )
        )
    strict = _config.get_config().strict
    eager = _clone(fn(*args))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with trace() as tr, torch.cuda.graph(graph):
            static = fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported (or raised in strict mode) with its type and message
        kernels = tuple(f"{o}:{k}" for (o, k) in tr.counts)
        msg = f"capture failed: {type(exc).__name__}: {exc}"
        if strict:
            raise CudaGraphUnsafeError(f"lz.validate_graph_capture: {msg}") from exc
        return GraphCheck(False, math.inf, 0, kernels, msg)
    kernels = tuple(f"{o}:{k}" for (o, k) in tr.counts)
    worst, problem, done = 0.0, None, 0
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        done += 1
        err, problem = _compare(static, eager, rtol, atol)
        worst = max(worst, err)
        if problem:
            break
    if problem and strict:
        raise CudaGraphUnsafeError(
            f"lz.validate_graph_capture: replay {done} differs from eager: {problem} "
            f"(kernels: {', '.join(kernels)})"
        )
    return GraphCheck(problem is None, worst, done, kernels, problem)


__all__ = [
    "GRAPH_TOLERANCES",
    "GraphCheck",
    "capture_selection",
    "is_graph_safe",
    "validate_graph_capture",
    "warmup",
]
