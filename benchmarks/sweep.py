"""The H200 proof sweep: every kernel LayerZero can run, per shape, against LayerZero's pick and SDPA's
default.

For each shape (``_sweep_shapes.full_shapes``: prefill and decode through ``lz.attention``, paged decode and
append through ``lz.paged_attention``; bf16/fp16, several GQA ratios and head dims) it

1. lists every kernel selection would consider (``lz.explain``), checks each against a float64 reference slice
   and drops (and records) the incorrect ones;
2. times each correct kernel bare, SDPA's default (``F.scaled_dot_product_attention``, no backend forced; for
   paged shapes the ``torch_sdpa.paged_attention`` kernel, SDPA over the gathered KV), the ``lz`` call end to
   end, and for paged decode at B >= 64 a device-to-device copy of the KV bytes read — with the
   ``lz.tune`` harness, interleaved in rounds; LayerZero's *default* pick uses an empty PerfDB;
3. runs ``lz.tune`` on every measured shape into a second, fresh PerfDB, then times everything again in a
   separate pass for the *tuned* pick;
4. writes ``sweep.csv``, ``sweep.md`` (machine, versions, per-shape table, targets PASS/FAIL, failed kernels)
   and ``env.json`` into ``--out``; ``benchmarks/plot_sweep.py`` turns the CSV into ``sweep.png``.

Usage (on the GPU machine; ``--device cpu --quick`` is the CPU smoke test)::

    PYTHONPATH=src python benchmarks/sweep.py --out benchmarks/results/h200_sweep [--max-minutes 7]
    PYTHONPATH=src python benchmarks/sweep.py --device cpu --quick --out /tmp/sweep_cpu

``--max-minutes`` (default 7) is a budget: pass 1 stops adding shapes at half of it, tuning at three
quarters, the tuned pass at the end; the outputs are always written. Exit status 0, or 1 with ``--strict``
when a target FAILs.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sweep_measure import COLUMNS, Timing, fill_sdpa_choice, measure_shape, retime_shape, tune_shape  # noqa: E402
from _sweep_report import (  # noqa: E402
    collect_env,
    compute_targets,
    open_device,
    read_csv,
    summarize,
    write_csv,
    write_env,
    write_markdown,
)
from _sweep_shapes import Shape, full_shapes, quick_shapes  # noqa: E402

import layerzero as lz  # noqa: E402
from layerzero.core.errors import ConfigurationError, expected_got  # noqa: E402

__all__ = ["main", "run_sweep"]

log = logging.getLogger("layerzero.benchmarks.sweep")
PHASE_SHARES = (0.5, 0.75, 1.0)
"""Budget shares at which pass 1, tuning and the tuned pass stop starting new shapes."""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _progress(
    i: int, n: int, what: str, shape: Shape, rows: list[dict[str, Any]], mode: str, t0: float
) -> None:
    """One line per shape on stderr: kernels timed, the fastest, the pick and its ratio, SDPA's default."""
    rs = [r for r in rows if str(r["shape_id"]) == str(i)]
    s = summarize(rs, mode)
    if not s:
        _say(f"[{what} {i + 1}/{n}] {shape.label()}: nothing timed ({time.monotonic() - t0:.0f} s)")
        return
    s0 = s[0]
    ok = sum(r["row_kind"] == "kernel" and r["status"] == "ok" for r in rs)

    def fmt(x: float | None) -> str:
        return "—" if x is None else f"{x:.3g}"

    _say(
        f"[{what} {i + 1}/{n}] {shape.label()}: {ok} kernels ok, fastest {s0['fastest']} "
        f"{fmt(s0['fastest_us'])} µs, pick {s0['pick']} ratio {fmt(s0['ratio'])}, SDPA default "
        f"{fmt(s0['sdpa_us'])} µs ({time.monotonic() - t0:.0f} s)"
    )


def run_sweep(
    shapes: list[Shape],
    device: torch.device,
    out: Path,
    *,
    timing: Timing,
    budget_s: float,
    command: str = "",
    tune: bool = True,
) -> dict[str, Any]:
    """Measure ``shapes`` on ``device`` (pass 1, tune, pass 2; see the module docstring) and write sweep.csv,
    sweep.md and env.json into ``out`` (created). The PerfDB path in effect before the call is restored.

    Returns ``{"rows": [...], "targets": [Target, ...], "meta": {...}}``.

    Raises:
        ConfigurationError: ``budget_s`` not > 0, or no shapes.
    """
    if not budget_s > 0:
        raise ConfigurationError(expected_got("sweep budget", "> 0 seconds", budget_s))
    if not shapes:
        raise ConfigurationError(expected_got("sweep shapes", "at least one", "none"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    old_path = lz.get_config().perfdb_path
    rows: list[dict[str, Any]] = []
    per_shape: dict[int, list[dict[str, Any]]] = {}
    tuned_by: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="lz_sweep_") as tmp:
        try:
            lz.configure(perfdb_path=str(Path(tmp) / "default.sqlite"))
            for i, shape in enumerate(shapes):
                if time.monotonic() - t0 > PHASE_SHARES[0] * budget_s:
                    _say(f"budget: pass 1 stops after {i} of {len(shapes)} shapes")
                    break
                try:
                    per_shape[i] = measure_shape(shape, i, device, timing)
                except Exception as exc:  # noqa: BLE001 - one broken shape (e.g. out of memory) must not end the run
                    log.warning(
                        "sweep: shape %s failed (%s: %s); skipped", shape.label(), type(exc).__name__, exc
                    )
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                rows += per_shape[i]
                _progress(i, len(shapes), "default", shape, rows, "default", t0)
            if tune:
                lz.configure(perfdb_path=str(Path(tmp) / "tuned.sqlite"))
                for i in per_shape:
                    if time.monotonic() - t0 > PHASE_SHARES[1] * budget_s:
                        _say(f"budget: tuning stops after {len(tuned_by)} of {len(per_shape)} shapes")
                        break
                    try:
                        tuned_by[i] = tune_shape(shapes[i], per_shape[i], device, timing)
                    except Exception as exc:  # noqa: BLE001
                        tuned_by[i] = f"not tuned: {type(exc).__name__}: {str(exc)[:150]}"
                    _say(f"[tune {i + 1}/{len(per_shape)}] {shapes[i].label()}: {tuned_by[i]}")
                retimed = 0
                for i in tuned_by:
                    if time.monotonic() - t0 > PHASE_SHARES[2] * budget_s:
                        _say(f"budget: the tuned pass stops after {retimed} of {len(tuned_by)} shapes")
                        break
                    try:
                        retime_shape(shapes[i], per_shape[i], device, timing)
                    except Exception as exc:  # noqa: BLE001
                        log.warning(
                            "sweep: tuned pass of %s failed (%s: %s)",
                            shapes[i].label(),
                            type(exc).__name__,
                            exc,
                        )
                    for r in per_shape[i]:
                        r["tuned_by"] = tuned_by[i]
                    retimed += 1
                    _progress(i, len(shapes), "tuned", shapes[i], rows, "tuned", t0)
        finally:
            lz.configure(perfdb_path=old_path)
    meta = {
        "command": command,
        "shapes_planned": len(shapes),
        "shapes_done": len(per_shape),
        "shapes_tuned": len(tuned_by),
        "elapsed_s": round(time.monotonic() - t0, 1),
        "budget_s": budget_s,
        "timing": {k: getattr(timing, k) for k in timing.__slots__},
    }
    targets = compute_targets(rows)
    env = collect_env(device)
    write_csv(out / "sweep.csv", rows, COLUMNS)
    write_markdown(out / "sweep.md", rows, targets, env, meta)
    write_env(out / "env.json", env, meta, targets)
    return {"rows": rows, "targets": targets, "meta": meta}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--out", type=Path, required=True, help="output directory (sweep.csv, sweep.md, env.json)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--max-minutes", type=float, default=7.0, help="time budget in minutes (default 7)")
    p.add_argument("--limit", type=int, default=None, help="only the first N shapes")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N shapes (after --phases)")
    p.add_argument(
        "--phases",
        nargs="+",
        default=None,
        help="only these phases (prefill decode paged_decode paged_append)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    p.add_argument("--iters", type=int, default=10, help="calls per sample (default 10)")
    p.add_argument("--repeats", type=int, default=10, help="samples per round (default 10)")
    p.add_argument(
        "--scores-gib-max",
        type=float,
        default=16.0,
        help="skip materializing kernels (reference, "
        "SDPA math, eager flex) above this score-matrix size in GiB (default 16)",
    )
    p.add_argument(
        "--exclude",
        nargs="+",
        default=(),
        help="kernel id glob patterns to leave out (e.g. "
        "'flex_attention.compiled' when torch.compile per shape costs too much of the budget)",
    )
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads with --device cpu (default 1)")
    p.add_argument("--no-tune", action="store_true", help="skip lz.tune and the tuned pass")
    p.add_argument(
        "--prewarm",
        type=int,
        default=0,
        metavar="N",
        help="before timing, compile every JIT kernel (FlashInfer, Triton) in N parallel worker "
        "processes (CUDA only; outside the --max-minutes budget)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    p.add_argument(
        "--fill-sdpa-choice",
        type=Path,
        default=None,
        metavar="CSV",
        help="only fill the empty sdpa_kernel column of an existing sweep.csv (SDPA's own sub-backend "
        "per shape, from torch._fused_sdp_choice on this device) and rewrite it into --out",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = open_device(args.device, "sweep", args.cpu_threads)
    if device is None:
        return 2
    if args.fill_sdpa_choice is not None:
        rows = read_csv(args.fill_sdpa_choice)
        n = fill_sdpa_choice(rows, device)
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "sweep.csv", rows, COLUMNS)
        _say(f"filled sdpa_kernel of {n} rows -> {args.out / 'sweep.csv'}")
        return 0
    shapes = quick_shapes() if args.quick else full_shapes()
    if args.phases:
        shapes = [s for s in shapes if s.phase in args.phases]
    shapes = shapes[args.skip :]
    shapes = shapes[: args.limit] if args.limit else shapes
    timing = Timing(
        iters=args.iters,
        repeats=args.repeats,
        rounds=args.rounds,
        scores_gib_max=args.scores_gib_max,
        exclude=tuple(args.exclude),
    )
    if args.quick:
        timing = replace(timing, warmup=1, iters=3, repeats=3, rounds=2, max_time_s=0.05)
    if args.prewarm and device.type == "cuda":
        from _sweep_prewarm import prewarm

        took, failures = prewarm(shapes, procs=args.prewarm)
        _say(
            f"prewarm: JIT kernels of {len(shapes)} shapes compiled in {took:.0f} s with {args.prewarm} "
            "workers"
            + (
                f"; {len(failures)} workers reported failures:\n  " + "\n  ".join(failures)
                if failures
                else ""
            )
        )
    command = "python benchmarks/sweep.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    res = run_sweep(
        shapes,
        device,
        args.out,
        timing=timing,
        budget_s=args.max_minutes * 60,
        command=command,
        tune=not args.no_tune,
    )
    for t in res["targets"]:
        value = "n/a" if t.value is None else f"{t.value:.3f}"
        print(f"{t.verdict():<4}  [{t.mode}] {t.name}: {value} (target {t.threshold or '—'}) {t.detail}")
    print(f"wrote {args.out / 'sweep.csv'}, {args.out / 'sweep.md'}, {args.out / 'env.json'}")
    return 1 if args.strict and any(t.passed is False for t in res["targets"]) else 0


if __name__ == "__main__":
    sys.exit(main())
