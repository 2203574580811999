"""Opt-in online autotune: measure a new key's kernels on its first eager call and record them in the PerfDB.

With ``lz.configure(autotune=True)`` (or ``LAYERZERO_AUTOTUNE=1``), dispatch calls :func:`autotune_context` on
the first eager call of a new key, before it selects; the selection then reads the fresh PerfDB rows, like
``torch.backends.cudnn.benchmark``. For that one call, each eligible kernel is

1. **checked**: run once on the call's own arguments and compared with the op's reference kernel as
   ``lz.tune`` does (:func:`~layerzero.tuning.stats.compare`, per-dtype tolerances; sampling kernels by
   support). A kernel that raises or differs is logged (WARNING) and not recorded;
2. **timed** as the :class:`AutotuneKnobs` in force say (``"tuning.autotune"``; by default two warm-up
   calls, then samples of 3 calls until 3 ms are spent, 5 samples at most, one at least): ``time_kernel`` of
   the harness (CUDA events on GPU); three times, the kernels in turn, each kernel's best round kept;
3. **recorded** under the call's bucket and device fingerprint, the key ``Runtime._perf_lookup`` reads.

Cost of the first call of a key: the reference once, then per eligible kernel 1 check + 3 x (2 warm-up + 3 to
15 timed calls) (about 15 x the kernel's time for kernels slower than 1 ms; ~10 ms in all for fast ones), plus
any JIT compilation a kernel does on first use (FlashInfer ~6 s per new variant, Triton ~1 s): those happen on
the first call instead of later. Nothing is measured when the bucket already has PerfDB rows for this device
(a later miss of the same bucket costs one PerfDB read), during CUDA-graph capture, with the PerfDB disabled,
for ``reshape_and_cache`` (it writes into the caller's cache), or when the reference kernel itself fails (for
example out of memory: the attention reference materializes the score matrix; it is computed in chunks of
batch and KV heads up to :data:`REFERENCE_CHUNK_BYTES`). The caller's tensors are not copied and not changed
(ops are functional); ``torch.Generator`` arguments and the global RNG states are restored afterwards.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core import config as _config
from layerzero.core import knobs
from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import Runtime, device_fingerprint_parts
from layerzero.core.errors import LayerZeroError
from layerzero.core.knobs import check_types, require
from layerzero.core.perfdb import fingerprint
from layerzero.core.selection import bind, kernel_reasons
from layerzero.core.specs import KernelSpec

from .harness import time_kernel
from .report import TuneRow, TuneStatus
from .stats import SAMPLING_OPS, check_sampled, compare, sample_stats

__all__ = [
    "KNOBS",
    "REFERENCE_CHUNK_BYTES",
    "AutotuneKnobs",
    "autotune_context",
    "eligible_kernels",
    "measure_context",
    "reference_output",
]

log = logging.getLogger("layerzero.autotune")

KNOBS = "tuning.autotune"
"""The name :class:`AutotuneKnobs` is registered under (``layerzero.core.knobs``)."""


@dataclass(frozen=True, slots=True)
class AutotuneKnobs:
    """Timing of one kernel by :func:`autotune_context`, registered as ``"tuning.autotune"``:
    ``time_kernel``'s arguments and :func:`measure_context`'s ``rounds``, read once per measured key
    (measurements: ``benchmarks/results/knobs/tuning_autotune.md``). Raises ``ConfigurationError`` for a field
    of the wrong type or out of range."""

    warmup: int = 2
    """Untimed calls of a kernel before its samples, each round."""
    iters: int = 3
    """Calls per timed sample."""
    repeats: int = 5
    """Most samples per kernel and round (at least one is taken)."""
    max_time_s: float = 0.003
    """Seconds of samples per kernel and round after which no further sample starts."""
    rounds: int = 3
    """Rounds over the kernels in turn, each kernel's best kept, as the shipped timings and the hidden-shape
    check do: fewer rounds misread eager kernels whose host time varies by round."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self.warmup >= 0, self, "warmup", "an int >= 0")
        for name in ("iters", "repeats", "rounds"):
            require(getattr(self, name) >= 1, self, name, "an int >= 1")
        require(self.max_time_s > 0, self, "max_time_s", "a number of seconds > 0")


knobs.register(KNOBS, AutotuneKnobs())

REFERENCE_CHUNK_BYTES = 1 << 30
"""Largest float32 score matrix (bytes) one call of the attention reference builds; larger calls are split
over batch and KV-head groups (the result is the same: attention is independent per batch and head)."""

_NOT_AUTOTUNED = frozenset({"reshape_and_cache"})


def eligible_kernels(
    runtime: Runtime, ctx: SelectionContext, kernels: Iterable[str] | None = None, exclude: Iterable[str] = ()
) -> list[KernelSpec]:
    """The kernels selection would consider for ``ctx`` (no constraint, availability, health or policy reason;
    locks are not consulted), optionally narrowed to ``kernels`` ids and without ids matching ``exclude``
    globs, in registration order."""
    runtime.ensure_ready()
    registry = runtime.registry
    policy = _config.effective_policy()
    fields = ctx.fields()
    wanted = None if kernels is None else set(kernels)
    out = []
    for spec in registry.for_op(ctx.op):
        if (wanted is not None and spec.kernel_id not in wanted) or any(
            fnmatch.fnmatchcase(spec.kernel_id, p) for p in exclude
        ):
            continue
        reasons = kernel_reasons(registry, spec, ctx, runtime.usable_reason)
        if not spec.is_reference:
            reasons += policy.reasons_against(ctx.op, spec.kernel_id, spec.backend, fields)
        if not reasons:
            out.append(spec)
    return out


def _dims(ctx: SelectionContext, args: tuple[Any, ...]) -> tuple[int, int, int, int, int]:
    """(B, Hq, Hkv, Sq, Sk) of an attention call's canonical args."""
    q, k = args[0], args[1]
    if ctx.layout is not None and ctx.layout.value == "BSHD":
        return q.shape[0], q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2]


def _needs_chunks(ctx: SelectionContext, args: tuple[Any, ...], max_bytes: int) -> bool:
    """An attention call without a mask whose float32 score matrix is over ``max_bytes``."""
    if ctx.op != "attention" or args[3] is not None:
        return False
    b, hq, _, sq, sk = _dims(ctx, args)
    return b * hq * sq * sk * 4 > max_bytes


def _chunks(ctx: SelectionContext, args: tuple[Any, ...], max_bytes: int) -> list[tuple[slice, slice, slice]]:
    """(batch, query-head, kv-head) slices of an attention call so each chunk's score matrix fits
    max_bytes."""
    b, hq, hkv, sq, sk = _dims(ctx, args)
    group = hq // hkv
    per_kv_head = group * sq * sk * 4
    kv_step = max(1, min(hkv, max_bytes // per_kv_head))
    b_step = max(1, min(b, max_bytes // (per_kv_head * hkv))) if kv_step == hkv else 1
    return [
        (slice(i, i + b_step), slice(h * group, (h + kv_step) * group), slice(h, h + kv_step))
        for i in range(0, b, b_step)
        for h in range(0, hkv, kv_step)
    ]


def reference_output(
    runtime: Runtime, ctx: SelectionContext, args: tuple[Any, ...], max_bytes: int = REFERENCE_CHUNK_BYTES
) -> Any:
    """The op's reference kernel on ``args`` (the canonical positional args), bound as dispatch binds it. An
    attention call without a mask whose float32 score matrix exceeds ``max_bytes`` runs in chunks of batch and
    KV heads (same result). Exceptions of the reference kernel propagate."""
    runtime.ensure_ready()
    registry = runtime.registry
    ref = bind(registry, registry.kernel(registry.ops.get(ctx.op).reference_kernel, ctx.op), ctx)[0]
    if not _needs_chunks(ctx, args, max_bytes):
        return ref(*args)
    q, k, v = args[:3]
    bshd = ctx.layout is not None and ctx.layout.value == "BSHD"
    out = None
    for bs, hs, ks in _chunks(ctx, args, max_bytes):
        where = (bs, slice(None), hs) if bshd else (bs, hs)
        part = ref(
            q[where],
            k[(bs, slice(None), ks) if bshd else (bs, ks)],
            v[(bs, slice(None), ks) if bshd else (bs, ks)],
            *args[3:],
        )
        if out is None:
            out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=part.dtype, device=part.device)
        out[where] = part
    return out


def _device(args: tuple[Any, ...]) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


def measure_context(
    runtime: Runtime,
    ctx: SelectionContext,
    args: tuple[Any, ...],
    *,
    warmup: int,
    iters: int,
    repeats: int,
    max_time_s: float,
    kernels: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    reference: Any = None,
    rounds: int = 1,
) -> list[tuple[TuneRow, tuple[float, ...]]]:
    """Check and time every eligible kernel of ``ctx`` on ``args`` (the op's canonical positional args, as
    dispatch passes them to kernels): ``[(row, kept samples µs), ...]`` in registration order.

    The check compares each kernel's output with ``reference`` (default: :func:`reference_output`; the
    reference kernel itself is then not timed when its score matrix needed chunks) as ``lz.tune`` does;
    kernels that raise or differ get an ``error`` / ``failed-check`` row and no samples (logged at WARNING).
    Timing: ``time_kernel`` with the given arguments, ``rounds`` times over the checked kernels in turn
    (round-robin, so a disturbed moment of the machine hits one round of one kernel, not all of its samples),
    each kernel's round with the smallest median kept; statistics: ``sample_stats``. ``args`` are used as they
    are (kernels are functional); generator states are reset before each kernel's check. Exceptions of the
    reference kernel propagate; a kernel's never do.
    """
    runtime.ensure_ready()
    device = _device(args)
    gens = [a for a in args if isinstance(a, torch.Generator)]
    states = [g.get_state() for g in gens]

    def reset() -> None:
        for g, st in zip(gens, states, strict=True):
            g.set_state(st)

    if reference is None:
        reference = reference_output(runtime, ctx, args)
        if _needs_chunks(ctx, args, REFERENCE_CHUNK_BYTES):  # the whole reference would not fit: not timed
            exclude = (*exclude, runtime.registry.ops.get(ctx.op).reference_kernel)
    specs = eligible_kernels(runtime, ctx, kernels, exclude)
    timing = {"warmup": warmup, "iters": iters, "repeats": repeats, "max_time_s": max_time_s}
    out: list[tuple[TuneRow, tuple[float, ...]]] = []
    checked: list[tuple[int, Callable[..., Any], float]] = []  # (row index in out, kernel, max error) to time
    for spec in specs:
        kid = spec.kernel_id
        fn: Callable[..., Any] = bind(runtime.registry, spec, ctx)[0]
        try:
            reset()
            result = fn(*args)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ok, err, why = (
                check_sampled(ctx.op, result, args) if ctx.op in SAMPLING_OPS else compare(result, reference)
            )
            del result
        except Exception as exc:  # noqa: BLE001 - a failing kernel is skipped, never fatal
            log.warning(
                "LayerZero measure %s: %s raised during the check (%s: %s); skipped",
                ctx.op,
                kid,
                type(exc).__name__,
                exc,
            )
            out.append(
                (TuneRow(0, kid, TuneStatus.ERROR, detail=f"check raised {type(exc).__name__}: {exc}"), ())
            )
            continue
        if not ok:
            log.warning(
                "LayerZero measure %s: %s differs from the reference kernel (%s); skipped", ctx.op, kid, why
            )
            out.append((TuneRow(0, kid, TuneStatus.FAILED_CHECK, max_error=err, detail=why), ()))
            continue
        checked.append((len(out), fn, err))
        out.append((TuneRow(0, kid, TuneStatus.OK, max_error=err), ()))
    for _ in range(max(1, rounds)):
        for i, fn, err in checked:
            kid = out[i][0].kernel_id
            if out[i][0].status is not TuneStatus.OK:
                continue
            try:
                samples = time_kernel(fn, args, device, **timing)
            except Exception as exc:  # noqa: BLE001
                log.warning(
                    "LayerZero measure %s: %s raised while timed (%s: %s)",
                    ctx.op,
                    kid,
                    type(exc).__name__,
                    exc,
                )
                out[i] = (TuneRow(0, kid, TuneStatus.ERROR, max_error=err, detail=f"timing raised {exc}"), ())
                continue
            st = sample_stats(samples)
            if not out[i][1] or st.median_us < out[i][0].median_us:
                out[i] = (
                    TuneRow(
                        0,
                        kid,
                        TuneStatus.OK,
                        st.median_us,
                        st.p95_us,
                        st.p99_us,
                        len(st.kept),
                        st.outliers,
                        err,
                    ),
                    st.kept,
                )
    reset()
    return out


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def autotune_context(runtime: Runtime, ctx: SelectionContext, args: tuple[Any, ...]) -> None:
    """Measure every eligible kernel of ``ctx`` on the call's ``args`` (canonical positional args) and record
    the ones that pass the check in ``runtime.perfdb()`` under ``ctx.bucket_key()`` and the device
    fingerprint.

    Does nothing during CUDA-graph capture (``ctx.graph_capture`` or a capturing stream), when the PerfDB is
    disabled or unusable, when the bucket already has rows for this fingerprint, or for ``reshape_and_cache``.
    Never raises: kernel failures, a failing reference kernel and PerfDB errors are logged. Does not
    invalidate the selection cache (the caller selects afterwards). See the module docstring for the cost.
    """
    device = _device(args)
    if ctx.graph_capture or _capturing(device) or ctx.op in _NOT_AUTOTUNED:
        return
    db = runtime.perfdb()
    if db is None:
        log.debug("LayerZero autotune %s: the PerfDB is disabled or unusable; nothing measured", ctx.op)
        return
    bucket, fp = ctx.bucket_key(), fingerprint(device_fingerprint_parts(ctx.device))
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    t0 = time.perf_counter()
    try:
        if db.for_bucket(ctx.op, bucket, fp):
            return
        with torch.no_grad():
            kn = knobs.get(KNOBS)
            results = measure_context(
                runtime,
                ctx,
                args,
                warmup=kn.warmup,
                iters=kn.iters,
                repeats=kn.repeats,
                max_time_s=kn.max_time_s,
                rounds=kn.rounds,
            )
    except Exception as exc:  # noqa: BLE001 - autotune must never break the call it serves
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("LayerZero autotune %s: nothing measured (%s: %s)", ctx.op, type(exc).__name__, exc)
        return
    finally:
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    recorded = []
    for row, kept in results:
        if not kept:
            continue
        try:
            db.record(row.kernel_id, ctx.op, bucket, fp, kept)
            recorded.append(f"{row.kernel_id} {row.median_us:.1f} us")
        except LayerZeroError as exc:
            log.warning("LayerZero autotune %s: could not record %s (%s)", ctx.op, row.kernel_id, exc)
    log.info(
        "LayerZero autotune %s: %d of %d kernels recorded in %.1f ms (%s)",
        ctx.op,
        len(recorded),
        len(results),
        (time.perf_counter() - t0) * 1e3,
        ", ".join(recorded) or "none",
    )
