"""``lz.tune``: check and time every eligible kernel on given inputs, and write the timings to the PerfDB.

For each case (the arguments of one ``lz.<op>`` call) the harness builds the cache key and the
:class:`SelectionContext` exactly as the op does (``layerzero.ops.OPS[op]``), lists the kernels selection
would consider (no constraint, availability or health reason, and allowed by the policy; ``kernels=``
narrows the list), and then, per kernel:

1. **check**: call it on fresh copies of the inputs and compare with the op's reference kernel
   (:func:`compare`, per-dtype tolerance :data:`~layerzero.tuning.stats.TOLERANCES`). A kernel that differs,
   or raises, is reported and never timed or recorded.
2. **time**: ``warmup`` untimed calls, then up to ``repeats`` samples, each the mean of ``iters`` back-to-back
   calls: CUDA ``torch.cuda.Event`` pairs around the calls (then ``Event.synchronize``), CPU
   ``time.perf_counter_ns``. Sampling stops early once ``max_time_s`` is spent on this kernel and case.
3. **summarize** (:func:`sample_stats`): drop samples beyond median + 5 x MAD, then median / p95 / p99.
4. **record** the kept samples in the PerfDB under (kernel, op, ``ctx.bucket_key()``, device fingerprint),
   the key selection reads on a cache miss.

Finally the selection cache is invalidated (``config.notify_change``) so the next call uses the timings.
Kernels are timed bare (through the same bound callable an ``ExecutionPlan`` holds, layout transposes
included), without dispatch overhead, which is the same for every kernel.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from layerzero.core import config as _config
from layerzero.core.arguments import check_call
from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import device_fingerprint_parts
from layerzero.core.errors import (
    CudaGraphUnsafeError,
    InvalidInputError,
    LayerZeroError,
    UnknownKernelError,
    UnknownOperationError,
    expected_got,
)
from layerzero.core.perfdb import fingerprint
from layerzero.core.registry import KernelRegistry
from layerzero.core.runtime import RUNTIME
from layerzero.core.selection import bind as _bind_plan
from layerzero.core.selection import kernel_reasons
from layerzero.core.specs import KernelSpec
from layerzero.ops import OPS

from .report import TuneReport, TuneRow, TuneStatus
from .shapes import make_inputs
from .stats import SAMPLING_OPS, check_sampled, compare, sample_stats

__all__ = ["bind", "time_kernel", "tune"]

log = logging.getLogger("layerzero.tuning")


def bind(registry: KernelRegistry, spec: KernelSpec, ctx: SelectionContext) -> Callable[..., Any]:
    """The callable an ``ExecutionPlan`` would hold for ``spec`` on ``ctx``: the kernel specialized for
    ``ctx`` and wrapped by the op's adapter (e.g. a BSHD <-> BHSD transpose). It takes the op's canonical
    positional arguments (see docs/architecture.md, "Adding a kernel")."""
    return _bind_plan(registry, spec, ctx)[0]


def _fresh(args: tuple[Any, ...], states: dict[int, torch.Tensor]) -> tuple[Any, ...]:
    """Copies of the tensor arguments (a kernel may write in place) and generators reset to their state at
    the start of the tune, so every kernel sees the same inputs and random stream."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.detach().clone().requires_grad_(a.requires_grad)
        elif isinstance(a, torch.Generator):
            a.set_state(states[id(a)])
        out.append(a)
    return tuple(out)


def time_kernel(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    repeats: int,
    max_time_s: float,
) -> list[float]:
    """Time ``fn(*args)``: ``warmup`` untimed calls, then up to ``repeats`` samples of ``iters`` calls each;
    returns µs per call, one value per sample (at least one sample, even past ``max_time_s`` seconds).

    CUDA: a ``torch.cuda.Event`` pair (``enable_timing=True``) recorded on the current stream around the
    ``iters`` calls, then ``end.synchronize()`` (so GPU time, launch gaps included). Other devices:
    ``time.perf_counter_ns`` around the calls (host time of a synchronous kernel).
    Exceptions of ``fn`` propagate.
    """
    if device.type == "cuda":
        with torch.cuda.device(device):
            return _time(fn, args, True, warmup, iters, repeats, max_time_s)
    return _time(fn, args, False, warmup, iters, repeats, max_time_s)


def _time(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    cuda: bool,
    warmup: int,
    iters: int,
    repeats: int,
    max_time_s: float,
) -> list[float]:
    for _ in range(warmup):
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    samples: list[float] = []
    deadline = time.monotonic() + max_time_s
    clock = time.perf_counter_ns
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn(*args)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000.0 / iters)
        else:
            t0 = clock()
            for _ in range(iters):
                fn(*args)
            samples.append((clock() - t0) / 1000.0 / iters)
        if time.monotonic() > deadline:
            break
    return samples


def _capturing_now() -> bool:
    """A CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Progress:
    """tqdm when installed, else one rewritten line on stderr; nothing when disabled."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self._bar = None
        self._n, self._total, self._enabled, self._desc = 0, total, enabled, desc
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, unit="kernel", leave=False)

    def step(self, what: str) -> None:
        """Advance by one (kernel, case) measurement and show ``what`` (the kernel id). Raises nothing."""
        self._n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(what)
            self._bar.update(1)
        elif self._enabled:
            print(f"\r{self._desc}: {self._n}/{self._total} {what:<40}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the progress display (close the tqdm bar or finish the stderr line). Raises nothing."""
        if self._bar is not None:
            self._bar.close()
        elif self._enabled:
            print(file=sys.stderr)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(expected_got(f"lz.tune({name})", f"an int >= {minimum}", repr(value)))
    return value


def _as_case(op: str, i: int, case: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(case, dict):
        bad = [k for k in case if not isinstance(k, str)]
        if bad:
            raise InvalidInputError(
                expected_got(
                    f"lz.tune case {i}: shape parameter names",
                    "str names like 'batch'",
                    f"{type(bad[0]).__name__} {bad[0]!r:.40}",
                )
            )
        return make_inputs(op, **case)
    if (
        isinstance(case, (tuple, list))
        and len(case) == 2
        and isinstance(case[0], (tuple, list))
        and isinstance(case[1], dict)
    ):
        return tuple(case[0]), dict(case[1])
    raise InvalidInputError(
        expected_got(
            f"lz.tune case {i}",
            "an (args tuple, kwargs dict) pair, or a dict of shape parameters",
            f"{type(case).__name__}: {case!r:.80}",
            "Write cases=[((q, k, v), {'is_causal': True})] or cases=[{'batch': 2, 'seq': 1024}] "
            "(see layerzero.tuning.make_inputs).",
        )
    )


def _selected(op: str, specs: Sequence[KernelSpec], kernels: Any) -> set[str]:
    ids = [s.kernel_id for s in specs]
    if kernels is None:
        return set(ids)
    patterns = [kernels] if isinstance(kernels, str) else list(kernels)
    out: set[str] = set()
    for p in patterns:
        if not isinstance(p, str):
            raise InvalidInputError(
                expected_got("lz.tune(kernels)", "kernel ids, backend ids or glob patterns", repr(p))
            )
        hit = {s.kernel_id for s in specs if fnmatch.fnmatchcase(s.kernel_id, p) or s.backend == p}
        if not hit:
            raise UnknownKernelError(
                f"lz.tune: {p!r} matches no kernel of op {op!r}. Kernels of {op!r}: {ids}."
            )
        out |= hit
    return out


def _label(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    names = RUNTIME.registry.ops.get(op).inputs
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    parts = [f"{names[i] if i < len(names) else f'arg{i}'}{list(t.shape)}" for i, t in enumerate(tensors)]
    if tensors:
        parts.insert(0, f"{str(tensors[0].dtype).removeprefix('torch.')} {tensors[0].device}")
    parts += [k for k, v in kwargs.items() if v is True]
    return " ".join(parts)


def _measure(
    spec: KernelSpec,
    case: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    ref: Any,
    states: dict[int, torch.Tensor],
    device: torch.device,
    timing: dict[str, Any],
) -> tuple[TuneRow, tuple]:
    """Check one kernel against the reference output, then time it: (row, kept samples)."""
    kid = spec.kernel_id
    try:
        out = fn(*_fresh(args, states))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - a failing kernel is reported, never fatal to the tune
        log.warning("lz.tune: %s raised during the check (%s: %s); not timed", kid, type(exc).__name__, exc)
        return TuneRow(case, kid, TuneStatus.ERROR, detail=f"check raised {type(exc).__name__}: {exc}"), ()
    ok, err, why = check_sampled(spec.op, out, args) if spec.op in SAMPLING_OPS else compare(out, ref)
    if not ok:
        log.warning("lz.tune: %s differs from the reference kernel (%s); not timed or recorded", kid, why)
        return TuneRow(case, kid, TuneStatus.FAILED_CHECK, max_error=err, detail=why), ()
    try:
        samples = time_kernel(fn, args, device, **timing)
    except Exception as exc:  # noqa: BLE001
        log.warning("lz.tune: %s raised while timed (%s: %s)", kid, type(exc).__name__, exc)
        return TuneRow(
            case, kid, TuneStatus.ERROR, max_error=err, detail=f"timing raised {type(exc).__name__}: {exc}"
        ), ()
    st = sample_stats(samples)
    detail = (
        ""
        if len(samples) == timing["repeats"]
        else (
            f"time budget {timing['max_time_s']:g} s reached after {len(samples)} of {timing['repeats']} "
            "samples"
        )
    )
    return TuneRow(
        case, kid, TuneStatus.OK, st.median_us, st.p95_us, st.p99_us, len(st.kept), st.outliers, err, detail
    ), st.kept


def tune(
    op: str,
    cases: Iterable[Any],
    *,
    kernels: str | Iterable[str] | None = None,
    warmup: int = 3,
    iters: int = 5,
    repeats: int = 20,
    max_time_s: float = 2.0,
    progress: bool = True,
) -> TuneReport:
    """Measure every eligible kernel of ``op`` on each case, record the timings in the PerfDB, and invalidate
    cached selections so the next ``lz.<op>`` call is scored with them (``Score.perf``).

    Args:
        op: op id (``"attention"``, ``"rms_norm"``, ``"layer_norm"``, ``"rope"``, ``"sample_topk"``,
            ``"sample_topp"``).
        cases: a list whose items are either ``(args, kwargs)`` — exactly what ``lz.<op>(*args, **kwargs)``
            takes, like ``lz.explain`` — or a dict of shape parameters for :func:`make_inputs`
            (``{"batch": 2, "heads": 32, "kv_heads": 8, "seq": 1024, "head_dim": 128, "dtype": "bfloat16",
            "device": "cuda", "causal": True}``). Sampling kernels are checked by support (every drawn token
            in the reference's top-k / nucleus set, see ``stats.check_sampled``), not by equal tokens.
        kernels: restrict to these kernel ids, backend ids or glob patterns (default: every eligible kernel).
            The reference kernel is always run as the oracle, but timed only when selected.
        warmup: untimed calls per kernel and case before sampling (JIT, caches, clocks).
        iters: calls per sample; a sample is their mean, µs per call.
        repeats: samples per kernel and case (at most).
        max_time_s: sampling budget per kernel and case, seconds; at least one sample is always taken.
        progress: show a progress bar (tqdm if installed, else a line on stderr).

    Returns:
        A :class:`TuneReport` (``print`` it for a table, ``.best()``, ``.to_dict()``).

    Raises:
        UnknownOperationError: unknown ``op``.
        UnknownKernelError: an entry of ``kernels`` matches no kernel of ``op``.
        InvalidInputError: a malformed case (not an ``(args, kwargs)`` pair or a dict; arguments that do not
            bind to ``lz.<op>``'s signature, e.g. a misspelt keyword), bad inputs for the op (the op's own
            message), or bad ``warmup``/``iters``/``repeats``/``max_time_s``.
        CudaGraphUnsafeError: called while a CUDA graph is being captured (timing would be captured too).

    A kernel that raises or differs from the reference beyond :data:`~layerzero.tuning.stats.TOLERANCES` is
    reported (status ``error`` / ``failed-check``, WARNING logged) and never recorded. When the PerfDB is
    disabled (``lz.configure(use_perfdb=False)``) or unusable, timings are reported but not stored (WARNING).
    """
    if not isinstance(op, str):
        raise UnknownOperationError(
            f"lz.tune: unknown op {op!r:.60}: "
            + expected_got("lz.tune(op)", f"an op id (a str) from {sorted(OPS)}", type(op).__name__)
        )
    if op not in OPS:
        raise UnknownOperationError(f"lz.tune: unknown op {op!r}. Known ops: {sorted(OPS)}.")
    timing = {
        "warmup": _check_int("warmup", warmup, 0),
        "iters": _check_int("iters", iters, 1),
        "repeats": _check_int("repeats", repeats, 1),
        "max_time_s": max_time_s,
    }
    if (
        isinstance(max_time_s, bool)
        or not isinstance(max_time_s, (int, float))
        or not math.isfinite(max_time_s)
        or max_time_s <= 0
    ):
        raise InvalidInputError(
            expected_got("lz.tune(max_time_s)", "a finite number of seconds > 0", repr(max_time_s))
        )
    if isinstance(cases, (dict, str)) or not isinstance(cases, Iterable):
        raise InvalidInputError(
            expected_got(
                "lz.tune(cases)",
                "a list of cases",
                type(cases).__name__,
                "Wrap a single case in a list: cases=[...].",
            )
        )
    if _capturing_now():
        raise CudaGraphUnsafeError(
            "lz.tune cannot run while a CUDA graph is being captured: the timing calls "
            "would be captured too. Tune before capturing (e.g. at start-up)."
        )
    prepare, build_ctx = OPS[op]
    RUNTIME.ensure_ready()
    registry = RUNTIME.registry
    specs = registry.for_op(op)
    chosen = _selected(op, specs, kernels)
    ref_spec = registry.kernel(registry.ops.get(op).reference_kernel, op)
    policy = _config.effective_policy()

    plans = []
    for i, raw in enumerate(list(cases)):
        args_kw = _as_case(op, i, raw)
        check_call(f"lz.tune({op!r}) case {i}", op, prepare, *args_kw)
        key, args = prepare(*args_kw[0], **args_kw[1])
        ctx = build_ctx(key)
        if ctx.graph_capture:
            raise CudaGraphUnsafeError(f"lz.tune case {i}: inputs are being captured in a CUDA graph.")
        fields = ctx.fields()
        rows, todo = [], []
        for spec in specs:
            if spec.kernel_id not in chosen:
                continue
            reasons = kernel_reasons(registry, spec, ctx, RUNTIME.usable_reason)
            if not spec.is_reference:
                reasons += policy.reasons_against(op, spec.kernel_id, spec.backend, fields)
            if reasons:
                rows.append(
                    TuneRow(
                        i,
                        spec.kernel_id,
                        TuneStatus.INELIGIBLE,
                        detail="; ".join(map(str, reasons)),
                        reason_codes=tuple(dict.fromkeys(r.code.value for r in reasons)),
                    )
                )
            else:
                todo.append(spec)
        plans.append((i, _label(op, *args_kw), ctx, args, rows, todo))
    if not plans:
        raise InvalidInputError(expected_got("lz.tune(cases)", "at least one case", "an empty list"))

    db = RUNTIME.perfdb()
    if db is None:
        log.warning(
            "lz.tune: the PerfDB is disabled or unusable (lz.get_config().use_perfdb / perfdb_path); "
            "timings are reported but not stored, so selection will not use them"
        )
    bar = _Progress(sum(len(p[5]) for p in plans), progress, f"lz.tune {op}")
    all_rows: list[TuneRow] = []
    labels, buckets, fps = [], [], []
    recorded = 0
    try:
        for i, label, ctx, args, rows, todo in plans:
            bucket = ctx.bucket_key()
            fp = fingerprint(device_fingerprint_parts(ctx.device))
            labels.append(label)
            buckets.append(bucket)
            fps.append(fp)
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            states = {id(a): a.get_state() for a in args if isinstance(a, torch.Generator)}
            ref_fn = bind(registry, ref_spec, ctx)
            try:
                ref = ref_fn(*_fresh(args, states))
                ref_error = ""
            except Exception as exc:  # noqa: BLE001
                ref, ref_error = (
                    None,
                    f"reference kernel {ref_spec.kernel_id} raised {type(exc).__name__}: {exc}",
                )
                log.warning("lz.tune case %d: %s; no kernel can be checked", i, ref_error)
            measured: dict[str, TuneRow] = {}
            for spec in todo:
                if ref_error:
                    row, kept = TuneRow(i, spec.kernel_id, TuneStatus.ERROR, detail=ref_error), ()
                else:
                    row, kept = _measure(
                        spec, i, bind(registry, spec, ctx), args, ref, states, device, timing
                    )
                if kept and db is not None:
                    try:
                        db.record(spec.kernel_id, op, bucket, fp, kept)
                        row = replace(row, recorded=True)
                        recorded += 1
                    except LayerZeroError as exc:
                        log.warning("lz.tune: could not record %s in the PerfDB (%s)", spec.kernel_id, exc)
                        row = replace(row, detail=f"not recorded: {exc}")
                measured[spec.kernel_id] = row
                bar.step(f"case {i} {spec.kernel_id}")
            order = {s.kernel_id: n for n, s in enumerate(specs)}
            all_rows += sorted([*rows, *measured.values()], key=lambda r: order[r.kernel_id])
    finally:
        bar.close()
        if recorded:
            _config.notify_change()
    dup = len(set(zip(buckets, fps, strict=True))) < len(buckets)
    if dup:
        log.info("lz.tune: several cases share a PerfDB bucket; the last case's timings are the ones stored")
    return TuneReport(
        op,
        tuple(labels),
        tuple(buckets),
        tuple(fps),
        tuple(all_rows),
        None if db is None or db.path is None else str(db.path),
    )
