"""Measurements of the H200 sweep: enumerate, check and time every kernel of one shape, tune, time again.

Candidates come from the public API (``lz.explain``: every kernel selection would consider for these inputs)
and are bound exactly as an ``ExecutionPlan`` binds them (``layerzero.tuning.bind``); timing reuses the tuning
harness (``layerzero.tuning.time_kernel``: warm-up, CUDA events, µs per call; ``sample_stats``: median / p95
after outlier removal), interleaved in rounds so that clock drift hits every kernel alike. Each kernel is
first checked against a float64 reference on a slice of the output (``_sweep_shapes``); a kernel outside the
dtype's tolerance (``layerzero.tuning.TOLERANCES``) or that raises is recorded and not timed.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _sweep_shapes import DTYPES, Inputs, Shape, build_inputs, reference_error, scores_bytes

import layerzero as lz
from layerzero.core.dispatch import device_fingerprint_parts
from layerzero.core.perfdb import fingerprint
from layerzero.core.report import CandidateStatus
from layerzero.core.runtime import RUNTIME
from layerzero.ops import OPS
from layerzero.tuning import TOLERANCES, TuneStatus, bind, sample_stats, time_kernel

BANDWIDTH_KINDS = ("kernel", "copy", "lz_graph")
__all__ = [
    "COLUMNS",
    "COPY",
    "LZ_CALL",
    "LZ_GRAPH",
    "SDPA_DEFAULT",
    "SDPA_KERNELS",
    "Timing",
    "fill_sdpa_choice",
    "copy_callee",
    "graph_callee",
    "measure_shape",
    "retime_shape",
    "sdpa_choice",
    "tune_shape",
]

log = logging.getLogger("layerzero.benchmarks.sweep")

SDPA_DEFAULT, LZ_CALL, COPY = "sdpa.default", "lz.call", "copy.d2d"
"""Kernel ids of the non-kernel rows: ``F.scaled_dot_product_attention`` with no backend forced, the public
``lz.<op>`` call end to end (dispatch included), and a device-to-device copy of the KV bytes read."""

LZ_GRAPH = "lz.graph"
GRAPH_CALLS = 10
"""Calls captured in one CUDA graph for the ``lz_graph`` rows (µs per call = replay / this)."""

COLUMNS = (
    "shape_id",
    "op",
    "phase",
    "B",
    "Sq",
    "Skv",
    "Hq",
    "Hkv",
    "D",
    "dtype",
    "page",
    "kernel_id",
    "row_kind",
    "status",
    "correct",
    "max_rel_err",
    "first_ms",
    "check_ms",
    "median_us",
    "p95_us",
    "samples",
    "tuned_median_us",
    "tuned_p95_us",
    "is_pick_default",
    "is_pick_tuned",
    "is_sdpa_default",
    "kv_bytes",
    "gbps",
    "tuned_by",
    "sdpa_kernel",
    "graph_us",
    "tuned_graph_us",
    "detail",
)
"""sweep.csv columns. row_kind: ``kernel`` (a registered kernel, bound bare), ``sdpa_default``, ``lz_call``,
``copy``, and for paged decode at B >= 64 ``lz_graph`` (the lz call replayed from a CUDA graph of
:data:`GRAPH_CALLS` calls: kernel time without host overhead; it runs the graph-safe kernel selection picks
under capture). The copy stays eager: captured in a graph, a device-to-device copy runs as a memcpy node at
~2.7 TB/s on the H200 instead of ~4.2 TB/s, which would flatter the kernels. sdpa_kernel (SDPA default row):
the sub-backend SDPA itself runs for these inputs (``torch._fused_sdp_choice``). graph_us / tuned_graph_us
(attention shapes on CUDA, the pick's row and the SDPA default row of that pass): µs per call replayed from a
CUDA graph (kernel time without host launch time; empty when the callable cannot be captured). status: ``ok``
(checked and timed), ``incorrect``, ``error``, ``skipped``. µs per call; gbps in GB/s (1e9 bytes/s): KV bytes
read / time for kernels, (read + write) / time for the copy."""


@dataclass(frozen=True, slots=True)
class Timing:
    """How each callable is timed and which kernels are skipped.

    Attributes:
        warmup: untimed calls before the first round (after the check and one extra warm call, so JIT
            compilation of flashinfer / Triton / flex kernels never lands in a sample).
        iters: calls per sample (a sample is their mean, µs per call). repeats: samples per round.
        rounds: rounds; the callables of a shape are interleaved within each round.
        max_time_s: sampling budget per callable and round, seconds (one sample at least).
        slow_ms: a callable whose warm call takes longer than this (ms) gets one round of one sample.
        scores_gib_max: kernels matching ``materializing`` are skipped when one float32 score matrix of the
            shape (``scores_bytes``) exceeds this many GiB; lz.tune is not run on such shapes either (its
            reference kernel would materialize it): the sweep's own measurements seed the PerfDB instead.
        materializing: glob patterns of kernel ids that build the full score matrix.
        exclude: glob patterns of kernel ids left out of the sweep (rows say ``skipped: excluded``).
    """

    warmup: int = 3
    iters: int = 10
    repeats: int = 10
    rounds: int = 3
    max_time_s: float = 0.25
    slow_ms: float = 500.0
    scores_gib_max: float = 16.0
    materializing: tuple[str, ...] = ("reference.*", "torch_sdpa.math", "flex_attention.attention")
    exclude: tuple[str, ...] = ()

    def too_big(self, shape: Shape) -> bool:
        """The shape's score matrix is over ``scores_gib_max``."""
        return scores_bytes(shape) > self.scores_gib_max * (1 << 30)


@dataclass(slots=True)
class _Callee:
    """One thing to time on a shape: its row and how to call it."""

    row: dict[str, Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    slow: bool = False
    calls: int = 1  # op calls per fn call (a CUDA graph replay runs GRAPH_CALLS)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _base(shape: Shape, shape_id: int, kernel_id: str, kind: str, kv_bytes: int) -> dict[str, Any]:
    row = dict.fromkeys(COLUMNS, "")
    row.update(
        shape_id=shape_id,
        op=shape.op,
        phase=shape.phase,
        B=shape.batch,
        Sq=shape.q_len,
        Skv=shape.kv_len,
        Hq=shape.hq,
        Hkv=shape.hkv,
        D=shape.head_dim,
        dtype=shape.dtype,
        page=shape.page,
        kernel_id=kernel_id,
        row_kind=kind,
        is_pick_default=False,
        is_pick_tuned=False,
        is_sdpa_default=False,
        kv_bytes=kv_bytes,
        status="skipped",
    )
    return row


def _call_op(shape: Shape, inputs: Inputs) -> Callable[[], Any]:
    fn = lz.paged_attention if shape.paged else lz.attention
    args, kwargs = inputs.args, inputs.kwargs
    return lambda: fn(*args, **kwargs)


def _sdpa(shape: Shape, inputs: Inputs) -> Callable[[], Any]:
    q, k, v = inputs.args
    causal, gqa = inputs.kwargs["is_causal"], shape.hq != shape.hkv
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


SDPA_KERNELS = {
    "FLASH_ATTENTION": "torch_sdpa.flash",
    "EFFICIENT_ATTENTION": "torch_sdpa.efficient",
    "CUDNN_ATTENTION": "torch_sdpa.cudnn",
    "MATH": "torch_sdpa.math",
}


def sdpa_choice(shape: Shape, inputs: Inputs) -> str:
    """The kernel id of the sub-backend SDPA's default runs for these inputs (``torch._fused_sdp_choice``, the
    private function SDPA itself dispatches on; ``""`` when it is missing or fails)."""
    q, k, v = inputs.args
    try:
        choice = torch._fused_sdp_choice(
            q, k, v, None, 0.0, inputs.kwargs["is_causal"], scale=None, enable_gqa=shape.hq != shape.hkv
        )
        from torch.nn.attention import SDPBackend

        return SDPA_KERNELS.get(SDPBackend(choice).name, SDPBackend(choice).name)
    except Exception:  # noqa: BLE001 - private API: the column stays empty
        return ""


def fill_sdpa_choice(rows: list[dict[str, Any]], device: torch.device) -> int:
    """Fill an empty ``sdpa_kernel`` of every SDPA-default row (a CSV written before the column was filled)
    from the shape's inputs rebuilt on ``device``; returns how many rows were filled. The choice depends on
    shapes, dtypes and the device only, so the rows' measurements stay valid."""
    done = 0
    for r in rows:
        if r["row_kind"] != "sdpa_default" or r.get("sdpa_kernel"):
            continue
        shape = Shape.from_row(r)
        inputs = build_inputs(shape, device)
        r["sdpa_kernel"] = sdpa_choice(shape, inputs)
        done += bool(r["sdpa_kernel"])
        del inputs
        _free(device)
    return done


def graph_callee(row: dict[str, Any], fn: Callable[[], Any], device: torch.device) -> _Callee:
    """A callee replaying ``fn`` captured :data:`GRAPH_CALLS` times in one CUDA graph (``fn`` warmed up on a
    side stream first, as the PyTorch CUDA-graphs notes do). For ``lz.*`` calls ``lz.warmup`` must have filled
    the capture-time selection first. Capture errors propagate."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with lz.trace() as tr, torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    served = [k for (_, k), _ in tr.counts.most_common()]
    row.update(
        status="ok",
        detail=f"CUDA graph of {GRAPH_CALLS} calls" + (f"; ran {', '.join(served)}" if served else ""),
    )
    row["_graph"] = graph  # keeps the graph (and its pool) alive while it is timed
    return _Callee(row, graph.replay, (), calls=GRAPH_CALLS)


def graph_kernel_times(
    pairs: list[tuple[dict[str, Any], Callable[[], Any]]], device: torch.device, timing: Timing, column: str
) -> None:
    """Kernel time of each ``(row, fn)``: ``fn`` captured :data:`GRAPH_CALLS` times in a CUDA graph, the
    replays timed interleaved in ``timing.rounds`` rounds; µs per call into ``row[column]``. A callable that
    cannot be captured (e.g. it plans on the host) keeps an empty column."""
    callees = []
    for row, fn in pairs:
        try:
            callees.append(graph_callee({}, fn, device))
            callees[-1].row.update(_target=row)
        except Exception:  # noqa: BLE001 - not capturable: no kernel time, the eager time stands
            _free(device)
    samples: dict[int, list[float]] = {i: [] for i in range(len(callees))}
    for r in range(timing.rounds):
        for i, c in enumerate(callees):
            samples[i] += time_kernel(
                c.fn,
                (),
                device,
                warmup=2 if r == 0 else 1,
                iters=max(1, timing.iters // 2),
                repeats=timing.repeats,
                max_time_s=timing.max_time_s,
            )
    for i, c in enumerate(callees):
        c.row["_target"][column] = round(sample_stats([x / c.calls for x in samples[i]]).median_us, 3)
    del callees
    _free(device)


def _graph_callees(
    shape: Shape,
    shape_id: int,
    inputs: Inputs,
    device: torch.device,
    rows: dict[str, dict[str, Any]] | None = None,
) -> list[_Callee]:
    """The lz call replayed from a CUDA graph (paged decode at B >= 64; see :data:`COLUMNS`); after
    ``lz.warmup`` filled the capture-time selection. A capture that fails leaves the row with status ``error``
    (never timed). ``rows``: reuse the pass-1 row (pass 2)."""
    args, kwargs = inputs.args, inputs.kwargs
    row = (rows or {}).get(LZ_GRAPH) or _base(shape, shape_id, LZ_GRAPH, "lz_graph", inputs.kv_bytes)
    before = row["detail"] if rows is not None else ""
    fn = lambda: lz.paged_attention(*args, **kwargs)  # noqa: E731
    try:
        lz.warmup("paged_attention", [(args, kwargs)])
        callee = graph_callee(row, fn, device)
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        _free(device)
        row.update(status="error", detail=f"capture raised {type(exc).__name__}: {str(exc)[:300]}")
        return [] if rows is not None else [_Callee(row, fn, ())]
    if before:
        row["detail"] = f"{before} | tuned pass: {row['detail']}"
    return [callee]


def _check(
    callee: _Callee,
    shape: Shape,
    inputs: Inputs,
    device: torch.device,
    timing: Timing,
    memo: dict[Any, torch.Tensor],
) -> bool:
    """Run once (timed: ``first_ms`` includes any JIT compilation) and compare with the float64 reference
    slice; then one warm call (timed: ``check_ms``, decides ``slow``). Fills the row's status / correct /
    max_rel_err / first_ms / check_ms / detail; True when it may be timed."""
    row = callee.row
    try:
        t0 = time.perf_counter()
        out = callee.fn(*callee.args)
        _sync(device)
        row["first_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        err = reference_error(shape, inputs, out, memo)
        del out
        tol = TOLERANCES[DTYPES[shape.dtype]]
        row.update(max_rel_err=err, correct=err <= tol)
        if err > tol:
            row.update(
                status="incorrect",
                detail=f"max |out - ref| / (1 + |ref|) = {err:.3g} > {tol:g} "
                f"({shape.dtype} tolerance, float64 reference slice)",
            )
            log.warning("sweep %s: %s is incorrect (%s)", shape.label(), row["kernel_id"], row["detail"])
            return False
        t0 = time.perf_counter()
        callee.fn(*callee.args)
        _sync(device)
        ms = (time.perf_counter() - t0) * 1e3
    except Exception as exc:  # noqa: BLE001 - a failing kernel is a result of the sweep, never fatal
        _free(device)
        row.update(status="error", correct=False, detail=f"{type(exc).__name__}: {str(exc)[:300]}")
        log.warning("sweep %s: %s raised (%s)", shape.label(), row["kernel_id"], row["detail"])
        return False
    row["check_ms"] = round(ms, 3)
    callee.slow = ms > timing.slow_ms
    return True


def _time_all(callees: list[_Callee], device: torch.device, timing: Timing, tuned: bool) -> None:
    """Time every callee, interleaved in ``timing.rounds`` rounds; write median / p95 / samples (or the
    ``tuned_`` columns when ``tuned``) into their rows. A callee that raises gets status ``error``."""
    samples: dict[int, list[float]] = {i: [] for i in range(len(callees))}
    for r in range(timing.rounds):
        for i, c in enumerate(callees):
            if c.row["status"] == "error" or (c.slow and r > 0):
                continue
            try:
                samples[i] += time_kernel(
                    c.fn,
                    c.args,
                    device,
                    warmup=timing.warmup if r == 0 else 1,
                    iters=1 if c.slow else timing.iters,
                    repeats=1 if c.slow else timing.repeats,
                    max_time_s=timing.max_time_s,
                )
            except Exception as exc:  # noqa: BLE001
                _free(device)
                c.row.update(status="error", detail=f"timing raised {type(exc).__name__}: {str(exc)[:300]}")
    prefix = "tuned_" if tuned else ""
    for i, c in enumerate(callees):
        if c.row["status"] == "error" or not samples[i]:
            continue
        st = sample_stats([x / c.calls for x in samples[i]])
        c.row[prefix + "median_us"], c.row[prefix + "p95_us"] = round(st.median_us, 3), round(st.p95_us, 3)
        if not tuned:
            c.row.update(samples=len(st.kept), status="ok")
            c.row["_kept"] = st.kept
        kv = c.row["kv_bytes"]
        if not tuned and c.row["phase"] == "paged_decode" and c.row["row_kind"] in BANDWIDTH_KINDS:
            factor = 2 if c.row["row_kind"] == "copy" else 1
            c.row["gbps"] = round(factor * kv / (st.median_us * 1e-6) / 1e9, 2)


def _callees(
    shape: Shape, shape_id: int, inputs: Inputs, timing: Timing, pick: str
) -> tuple[list[_Callee], list[dict[str, Any]]]:
    """The callables of one shape: every kernel ``lz.explain`` lists as selected/eligible (bound like a plan),
    SDPA's default (attention only), the lz call, and for paged decode at B >= 64 the copy. Returns
    (callees to check, rows of skipped kernels)."""
    op = shape.op
    report = lz.explain(op, *inputs.args, **inputs.kwargs)
    _, canonical = OPS[op][0](*inputs.args, **inputs.kwargs)
    out, skipped = [], []
    for cand in report.candidates:
        if cand.status is CandidateStatus.REJECTED:
            continue
        row = _base(shape, shape_id, cand.kernel_id, "kernel", inputs.kv_bytes)
        row["is_pick_default"] = cand.kernel_id == pick
        row["is_sdpa_default"] = shape.paged and cand.kernel_id == "torch_sdpa.paged_attention"
        if any(fnmatch.fnmatchcase(cand.kernel_id, p) for p in timing.exclude):
            row["detail"] = "skipped: excluded by --exclude"
            skipped.append(row)
            continue
        if timing.too_big(shape) and any(
            fnmatch.fnmatchcase(cand.kernel_id, p) for p in timing.materializing
        ):
            row["detail"] = (
                f"skipped: materializes a {scores_bytes(shape) / (1 << 30):.1f} GiB score matrix "
                f"(> --scores-gib-max {timing.scores_gib_max:g})"
            )
            skipped.append(row)
            continue
        spec = RUNTIME.registry.kernel(cand.kernel_id, op)
        out.append(_Callee(row, bind(RUNTIME.registry, spec, report.context), canonical))
    if not shape.paged:
        row = _base(shape, shape_id, SDPA_DEFAULT, "sdpa_default", inputs.kv_bytes)
        row.update(is_sdpa_default=True, sdpa_kernel=sdpa_choice(shape, inputs))
        out.append(_Callee(row, _sdpa(shape, inputs), ()))
    out.append(
        _Callee(_base(shape, shape_id, LZ_CALL, "lz_call", inputs.kv_bytes), _call_op(shape, inputs), ())
    )
    return out, skipped


def copy_callee(shape: Shape, shape_id: int, inputs: Inputs) -> _Callee:
    """``dst.copy_(src)`` of ``inputs.kv_bytes`` bytes taken from the cache itself (no second big buffer)."""
    cache = inputs.args[1]
    src = cache.view(-1)[: inputs.kv_bytes // cache.element_size()]
    dst = torch.empty_like(src)
    row = _base(shape, shape_id, COPY, "copy", inputs.kv_bytes)
    row.update(status="ok", detail="device-to-device copy of the KV bytes read; gbps counts read + write")
    return _Callee(row, dst.copy_, (src,))


def _pick_and_sdpa_graph_times(
    shape: Shape, timed: list[_Callee], device: torch.device, timing: Timing, pick_flag: str, column: str
) -> None:
    """Attention shapes on CUDA: the pick's and SDPA's default kernel time from CUDA-graph replays (the target
    compares kernel times; eager times of launch-bound shapes measure the host)."""
    if shape.paged or device.type != "cuda":
        return

    def graph_safe(row: dict[str, Any]) -> bool:  # only kernels declared graph-safe are captured
        return (
            row["row_kind"] == "sdpa_default"
            or RUNTIME.registry.kernel(row["kernel_id"], shape.op).graph_safe
        )

    pairs = [
        (c.row, (lambda c=c: c.fn(*c.args)))
        for c in timed
        if c.row["status"] == "ok"
        and (c.row["row_kind"] == "sdpa_default" or (c.row["row_kind"] == "kernel" and c.row[pick_flag]))
    ]
    if len(pairs) == 2 and all(graph_safe(r) for r, _ in pairs):
        try:
            graph_kernel_times(pairs, device, timing, column)
        except Exception as exc:  # noqa: BLE001 - the eager comparison stands
            _free(device)
            log.warning(
                "sweep %s: CUDA-graph kernel timing failed (%s: %s)", shape.label(), type(exc).__name__, exc
            )


def measure_shape(shape: Shape, shape_id: int, device: torch.device, timing: Timing) -> list[dict[str, Any]]:
    """Pass 1 (default mode, fresh PerfDB set by the caller): check and time every eligible kernel, SDPA's
    default, the lz call and (paged decode, B >= 64) the copy; one row per callable (see :data:`COLUMNS`).
    Rows of timed callables carry ``_kept`` (the kept samples, µs) for seeding the PerfDB."""
    inputs = build_inputs(shape, device)
    pick = lz.which(shape.op, *inputs.args, **inputs.kwargs)
    callees, rows = _callees(shape, shape_id, inputs, timing, pick)
    memo: dict[Any, torch.Tensor] = {}
    timed = [
        c for c in callees if c.row["row_kind"] == "lz_call" or _check(c, shape, inputs, device, timing, memo)
    ]
    del memo
    if shape.phase == "paged_decode" and shape.batch >= 64:
        timed.append(copy_callee(shape, shape_id, inputs))
        timed += _graph_callees(shape, shape_id, inputs, device)
    _time_all(timed, device, timing, tuned=False)
    _pick_and_sdpa_graph_times(shape, timed, device, timing, "is_pick_default", "graph_us")
    lz_row = next(c.row for c in callees if c.row["row_kind"] == "lz_call")
    lz_row["detail"] = f"picked {pick}"
    rows += [c.row for c in callees]
    rows += [c.row for c in timed if c.row["row_kind"] in ("copy", "lz_graph")]
    for r in rows:
        r.pop("_graph", None)
    del inputs, callees, timed
    _free(device)
    return rows


def tune_shape(shape: Shape, rows: list[dict[str, Any]], device: torch.device, timing: Timing) -> str:
    """Tune ``shape`` into the current PerfDB: ``lz.tune`` restricted to the kernels pass 1 timed; when the
    shape is too big for tune's reference kernel, or tune recorded nothing, the pass-1 samples are written to
    the PerfDB under the same key ``lz.tune`` uses. Returns how it was tuned (the ``tuned_by`` column)."""
    ok = {r["kernel_id"]: r for r in rows if r["row_kind"] == "kernel" and r["status"] == "ok"}
    if not ok:
        return "not tuned: no kernel passed the check"
    inputs = build_inputs(shape, device)
    how = ""
    if not timing.too_big(shape):
        try:
            rep = lz.tune(
                shape.op,
                [(inputs.args, inputs.kwargs)],
                kernels=sorted(ok),
                warmup=2,
                iters=timing.iters,
                repeats=timing.repeats,
                max_time_s=timing.max_time_s,
                progress=False,
            )
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: fall back to the sweep's samples
            _free(device)
            rep = None
            how = f"sweep samples (lz.tune raised {type(exc).__name__}: {str(exc)[:150]})"
        if rep is None:
            pass
        elif any(r.recorded for r in rep.rows):
            how = "lz.tune"
        else:
            why = "; ".join(f"{r.kernel_id}: {r.detail}" for r in rep.rows if r.status is not TuneStatus.OK)
            how = f"sweep samples (lz.tune recorded nothing: {why[:200]})"
    else:
        how = "sweep samples (shape too big for lz.tune's reference kernel)"
    if how != "lz.tune":
        db = RUNTIME.perfdb()
        key, _ = OPS[shape.op][0](*inputs.args, **inputs.kwargs)
        ctx = OPS[shape.op][1](key)
        fp = fingerprint(device_fingerprint_parts(ctx.device))
        if db is None:
            how = "not tuned: PerfDB disabled"
        else:
            for kid, r in ok.items():
                db.record(kid, shape.op, ctx.bucket_key(), fp, list(r["_kept"]))
            lz.configure()  # invalidate cached selections, as lz.tune does after recording
    del inputs
    _free(device)
    return how


def retime_shape(shape: Shape, rows: list[dict[str, Any]], device: torch.device, timing: Timing) -> None:
    """Pass 2 (tuned PerfDB set by the caller): the tuned pick, then a separate timing of every callable pass
    1 timed, side by side; fills ``tuned_median_us`` / ``tuned_p95_us`` / ``is_pick_tuned`` in ``rows``."""
    inputs = build_inputs(shape, device)
    pick = lz.which(shape.op, *inputs.args, **inputs.kwargs)
    by_id = {r["kernel_id"]: r for r in rows}
    callees, _ = _callees(shape, -1, inputs, timing, pick)
    todo = []
    for c in callees:
        row = by_id.get(c.row["kernel_id"])
        if row is None:
            continue
        if row["row_kind"] == "kernel":
            row["is_pick_tuned"] = c.row["kernel_id"] == pick
        if row["status"] == "ok":
            todo.append(
                _Callee(
                    row,
                    c.fn,
                    c.args,
                    slow=isinstance(row["check_ms"], float) and row["check_ms"] > timing.slow_ms,
                )
            )
    if COPY in by_id:
        copy = copy_callee(shape, -1, inputs)
        todo.append(_Callee(by_id[COPY], copy.fn, copy.args))
    if LZ_GRAPH in by_id:
        todo += _graph_callees(shape, -1, inputs, device, by_id)
    if LZ_CALL in by_id:
        by_id[LZ_CALL]["detail"] = (
            f"picked {by_id[LZ_CALL]['detail'].removeprefix('picked ')} (default), {pick} (tuned)"
        )
    if not any(r["is_pick_tuned"] for r in rows):
        log.warning("sweep %s: the tuned pick %s is not among the kernels of pass 1", shape.label(), pick)
    _time_all(todo, device, timing, tuned=True)
    _pick_and_sdpa_graph_times(shape, todo, device, timing, "is_pick_tuned", "tuned_graph_us")
    for r in rows:
        r.pop("_graph", None)
    del inputs, callees, todo
    _free(device)
