"""Acceptance check of the shipped defaults and of autotune on shapes ``ship_timings.py`` never measured.

For each hidden shape (:func:`hidden_cases`: 24 dense attention shapes and 11 ragged paged-decode shapes
between the grid's points: odd lengths, other batch sizes and head counts, other ragged length distributions;
seeded):

1. **autotune pick**: a fresh PerfDB, ``autotune_context`` on the call (what ``lz.configure(autotune=True)``
   does on a key's first eager call; its cost is reported as ``autotune_ms``), then selection;
2. **every eligible kernel** checked against the reference kernel and timed with the ``lz.tune`` harness
   (``measure_context``; eager, CUDA events), ``--rounds`` times (default 3), keeping each kernel's smallest
   round median: a ~20 µs kernel's eager time is partly its launch cost on the host, and one round can read it
   1.7x slow;
3. **default pick**: selection with an empty PerfDB and shipped timings on (a fresh process's choice).

Kernels left out of the timing (``--exclude``, default ``flex_attention.compiled``: ``torch.compile`` per
shape) are denied by a scoped policy for both picks, so neither can pick a kernel that was not timed.

Each pick is scored as ``fastest correct median / pick's median`` (1.0 = the fastest; a pick that failed the
check scores 0). Targets: default geomean >= 0.97 and none < 0.90; autotune geomean >= 0.99 and none < 0.95.
Writes ``hidden_shapes.md``, ``hidden_shapes.csv``, ``hidden_shapes.png`` (with matplotlib) and ``env.json``
into ``--out``.

Usage (after ``ship_timings.py`` installed this GPU's data file, or with ``--shipped-dir`` pointing at the
``timings/`` directory of its ``--out``; about 4-6 minutes on an H100)::

    PYTHONPATH=src python benchmarks/hidden_shapes.py --out benchmarks/results/h100_hidden
    # 12 CPU shapes, then a smoke test:
    PYTHONPATH=src python benchmarks/hidden_shapes.py --device cpu --cpu-threads 1 --out /tmp/hidden_cpu
    PYTHONPATH=src python benchmarks/hidden_shapes.py --device cpu --quick --out /tmp/hidden_quick
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import logging
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ship_grid import Case  # noqa: E402
from _ship_measure import Measured, measure_rounds, prepare_case, prewarm_cases  # noqa: E402
from _sweep_report import collect_env, open_device  # noqa: E402

import layerzero as lz  # noqa: E402
from layerzero.core import shipped  # noqa: E402
from layerzero.core.config import scoped_policy  # noqa: E402
from layerzero.core.device import DeviceSpec  # noqa: E402
from layerzero.core.policy import DenyRule, Policy  # noqa: E402
from layerzero.core.runtime import RUNTIME  # noqa: E402
from layerzero.tuning.autotune import autotune_context  # noqa: E402

__all__ = ["TARGETS", "cpu_hidden_cases", "evaluate", "hidden_cases", "main", "quick_cases", "summarize"]

log = logging.getLogger("layerzero.benchmarks.hidden")
TARGETS = {"default": (0.97, 0.90), "autotune": (0.99, 0.95), "priority": (None, None)}
"""(geomean at least, every shape at least) of fastest / pick, per pick; ``priority`` (hand priorities alone,
the pick before shipped timings) is reported for comparison, without a target."""
COLUMNS = (
    "shape",
    "kind",
    "label",
    "kernel_id",
    "status",
    "median_us",
    "p95_us",
    "samples",
    "max_error",
    "is_fastest",
    "is_default",
    "is_autotune",
    "is_priority",
    "shipped_source",
    "autotune_ms",
    "detail",
)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def hidden_cases(dtype: str = "bfloat16") -> list[Case]:
    """24 dense + 11 paged-decode shapes, none a point of ``_ship_grid.gpu_grid`` (page 16)."""
    dense = [
        ("prefill", 2, 3000, 3000, 32, 8, 128),
        ("prefill", 1, 777, 777, 32, 8, 128),
        ("prefill", 3, 1536, 1536, 64, 8, 128),
        ("prefill", 6, 700, 700, 32, 32, 64),
        ("prefill", 1, 12000, 12000, 32, 8, 128),
        ("prefill", 2, 5000, 5000, 48, 6, 256),
        ("prefill", 12, 300, 300, 28, 7, 128),
        ("prefill", 5, 2500, 2500, 24, 24, 64),
        ("prefill", 16, 100, 100, 32, 8, 64),
        ("prefill", 1, 9000, 9000, 64, 8, 128),
        ("decode", 3, 1, 3000, 32, 8, 128),
        ("decode", 24, 1, 1500, 32, 8, 128),
        ("decode", 48, 1, 700, 64, 8, 128),
        ("decode", 1, 1, 20000, 32, 8, 128),
        ("decode", 10, 1, 6000, 32, 32, 64),
        ("decode", 7, 1, 12000, 64, 8, 256),
        ("decode", 100, 1, 900, 32, 8, 128),
        ("decode", 200, 1, 300, 32, 8, 128),
        ("cross", 2, 100, 3000, 32, 8, 128),
        ("cross", 1, 40, 5000, 32, 32, 64),
        ("cross", 4, 300, 2000, 64, 8, 128),
        ("cross", 12, 20, 7000, 32, 8, 256),
        ("cross", 3, 64, 3500, 32, 8, 128),
        ("cross", 6, 200, 1200, 48, 6, 64),
    ]
    paged = [
        (7, 700, "skewed", 32, 8, 128),
        (24, 1500, "bimodal", 32, 8, 128),
        (48, 300, "skewed", 16, 2, 64),
        (100, 2500, "uniform", 32, 8, 128),
        (200, 900, "bimodal", 64, 8, 128),
        (3, 5000, "skewed", 32, 8, 256),
        (12, 200, "equal", 16, 2, 128),
        (33, 3000, "narrow", 64, 8, 64),
        (160, 400, "skewed", 32, 8, 64),
        (2, 12000, "uniform", 32, 8, 128),
        (60, 6000, "bimodal", 32, 8, 128),
    ]
    out = [
        Case(k, b, sq, sk, hq, hkv, d, dtype, seed=1000 + i)
        for i, (k, b, sq, sk, hq, hkv, d) in enumerate(dense)
    ]
    out += [
        Case("paged_decode", b, 1, m, hq, hkv, d, dtype, 16, dist, seed=2000 + i)
        for i, (b, m, dist, hq, hkv, d) in enumerate(paged)
    ]
    return out


def cpu_hidden_cases() -> list[Case]:
    """8 dense + 4 paged-decode CPU shapes, none a point of ``_ship_grid.cpu_grid`` (``--device cpu``)."""
    dense = [
        ("prefill", 2, 300, 300, 8, 2, 64, "float32"),
        ("prefill", 1, 700, 700, 8, 8, 128, "bfloat16"),
        ("prefill", 3, 100, 100, 8, 2, 128, "float32"),
        ("decode", 3, 1, 700, 8, 2, 64, "bfloat16"),
        ("decode", 2, 1, 3000, 8, 8, 128, "bfloat16"),
        ("decode", 1, 1, 1500, 8, 2, 128, "float32"),
        ("decode", 6, 1, 200, 8, 8, 64, "float32"),
        ("decode", 2, 1, 100, 8, 2, 64, "bfloat16"),
    ]
    paged = [
        (12, 400, "skewed", 8, 2, 128),
        (16, 300, "bimodal", 16, 2, 64),
        (6, 150, "skewed", 8, 2, 64),
        (3, 250, "bimodal", 16, 2, 128),
    ]
    return [
        Case(k, b, sq, sk, hq, hkv, d, dt, seed=3000 + i)
        for i, (k, b, sq, sk, hq, hkv, d, dt) in enumerate(dense)
    ] + [
        Case("paged_decode", b, 1, m, hq, hkv, d, "float32", 16, dist, seed=4000 + i)
        for i, (b, m, dist, hq, hkv, d) in enumerate(paged)
    ]


def quick_cases() -> list[Case]:
    """Tiny CPU shapes of every kind (the test of this script)."""
    return [
        Case("prefill", 3, 40, 40, 4, 2, 16, "float32", seed=1),
        Case("decode", 3, 1, 50, 4, 4, 16, "float32"),
        Case("cross", 1, 7, 50, 4, 2, 16, "float32"),
        Case("paged_decode", 5, 1, 30, 4, 2, 16, "float32", 16, "skewed", seed=3),
    ]


def _ratio(m: Measured, pick: str) -> float:
    ok, best = m.ok(), m.fastest()
    if best is None:
        return math.nan
    return best[1] / ok[pick] if pick in ok else 0.0


def evaluate(
    case: Case,
    device: torch.device,
    timing: dict[str, Any],
    tmp: Path,
    index: int,
    *,
    exclude: tuple[str, ...] = (),
    materializing_gib_max: float = 2.0,
    rounds: int = 1,
) -> dict[str, Any]:
    """Autotune pick, every kernel timed, default pick of one shape (see the module docstring), and for
    comparison the pick of priorities alone (empty PerfDB, shipped timings off). Returns ``{"case",
    "measured", "default", "autotune", "priority", "<pick>_ratio", "autotune_ms", "shipped_source"}``; the
    config is restored."""
    before = lz.get_config()
    # kernels left out of the timing may not be picked either (the reference kernel is never denied)
    deny = tuple(p for p in exclude if not p.startswith("reference"))
    layer = (
        Policy(deny=(DenyRule("*", deny, origin="hidden_shapes --exclude"),), source="hidden_shapes")
        if deny
        else Policy.empty()
    )
    with scoped_policy(layer):
        return _evaluate(case, device, timing, tmp, index, before, exclude, materializing_gib_max, rounds)


def _evaluate(
    case: Case,
    device: torch.device,
    timing: dict[str, Any],
    tmp: Path,
    index: int,
    before: Any,
    exclude: tuple[str, ...],
    materializing_gib_max: float,
    rounds: int,
) -> dict[str, Any]:
    try:
        lz.configure(
            perfdb_path=str(tmp / f"autotune-{index}.sqlite"), use_shipped_timings=True, autotune=False
        )
        ctx, canonical = prepare_case(case, device)
        t0 = time.perf_counter()
        autotune_context(RUNTIME, ctx, canonical)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        autotune_ms = (time.perf_counter() - t0) * 1e3
        auto_pick = RUNTIME.select_context(ctx)[0].kernel_id
        del canonical
        m = measure_rounds(case, device, timing, exclude, materializing_gib_max, rounds)
        lz.configure(perfdb_path=str(tmp / "empty.sqlite"))
        plan, report = RUNTIME.select_context(m.ctx)
        lz.configure(use_shipped_timings=False)
        prio_pick = RUNTIME.select_context(m.ctx)[0].kernel_id
    finally:
        lz.configure(perfdb_path=before.perfdb_path, use_shipped_timings=before.use_shipped_timings)
    return {
        "case": case,
        "measured": m,
        "default": plan.kernel_id,
        "autotune": auto_pick,
        "priority": prio_pick,
        "default_ratio": _ratio(m, plan.kernel_id),
        "autotune_ratio": _ratio(m, auto_pick),
        "priority_ratio": _ratio(m, prio_pick),
        "autotune_ms": autotune_ms,
        "shipped_source": report.shipped_source,
    }


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(max(x, 1e-9)) for x in xs) / len(xs)) if xs else math.nan


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per pick: geomean, min, the worst shape and PASS/FAIL against :data:`TARGETS` (shapes without a correct
    timed kernel are left out)."""
    out = {}
    for pick, (gm_min, each_min) in TARGETS.items():
        rs = [(r[f"{pick}_ratio"], r["case"].label()) for r in results if not math.isnan(r[f"{pick}_ratio"])]
        gm = _geomean([x for x, _ in rs])
        worst = min(rs) if rs else (math.nan, "")
        if gm_min is None:
            out[pick] = {
                "geomean": gm,
                "min": worst[0],
                "worst": worst[1],
                "shapes": len(rs),
                "target": "-",
                "verdict": "info",
            }
            continue
        ok = bool(rs) and gm >= gm_min and worst[0] >= each_min
        out[pick] = {
            "geomean": gm,
            "min": worst[0],
            "worst": worst[1],
            "shapes": len(rs),
            "target": f"geomean >= {gm_min}, none < {each_min}",
            "verdict": "PASS" if ok else "FAIL",
        }
    return out


def _write(out: Path, results: list[dict[str, Any]], summary: dict[str, Any], env: dict[str, Any]) -> None:
    rows = []
    for i, r in enumerate(results):
        m: Measured = r["measured"]
        best = m.fastest()
        for row in m.rows:
            rows.append(
                {
                    "shape": i,
                    "kind": r["case"].kind,
                    "label": r["case"].label(),
                    "kernel_id": row.kernel_id,
                    "status": row.status.value,
                    "median_us": row.median_us,
                    "p95_us": row.p95_us,
                    "samples": row.samples,
                    "max_error": row.max_error,
                    "is_fastest": best is not None and row.kernel_id == best[0],
                    "is_default": row.kernel_id == r["default"],
                    "is_autotune": row.kernel_id == r["autotune"],
                    "is_priority": row.kernel_id == r["priority"],
                    "shipped_source": r["shipped_source"] or "",
                    "autotune_ms": round(r["autotune_ms"], 1),
                    "detail": row.detail[:200],
                }
            )
    with (out / "hidden_shapes.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    lines = [
        "# Hidden shapes: shipped defaults and autotune vs the fastest correct kernel",
        "",
        f"{env.get('date', '')}: {env.get('device_name') or env.get('device')}, torch {env.get('torch')}, "
        f"cuDNN {env.get('cudnn')}, triton {env.get('triton')}, flashinfer {env.get('flashinfer')}",
        "",
        "Ratio = fastest correct median / pick's median (1.0 = the pick is the fastest; 0 = the pick failed "
        "the check). Default: empty PerfDB, shipped timings on. Autotune: a fresh PerfDB, `autotune_context` "
        "on the call, then selection.",
        "",
        "| pick | geomean | min (shape) | target | verdict |",
        "| --- | ---: | --- | --- | --- |",
    ]
    for pick, s in summary.items():
        lines.append(
            f"| {pick} | {s['geomean']:.3f} | {s['min']:.3f} ({s['worst']}) | {s['target']} | "
            f"**{s['verdict']}** |"
        )
    lines += [
        "",
        "| shape | shipped data | fastest (µs) | default (µs) | ratio | autotune (µs) | ratio | autotune ms "
        "| priorities alone | ratio |",
        "| --- | --- | --- | --- | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for r in results:
        m, best = r["measured"], r["measured"].fastest()
        ok = m.ok()

        def us(k: str, ok: dict[str, float] = ok) -> str:
            return f"{k} ({ok[k]:.1f})" if k in ok else f"{k} (not timed)"

        src = (r["shipped_source"] or "none").split(", ", 1)[-1]
        lines.append(
            f"| {r['case'].label()} | {src} | {'-' if best is None else us(best[0])} | {us(r['default'])} | "
            f"{r['default_ratio']:.3f} | {us(r['autotune'])} | {r['autotune_ratio']:.3f} | "
            f"{r['autotune_ms']:.0f} | {r['priority']} | {r['priority_ratio']:.3f} |"
        )
    (out / "hidden_shapes.md").write_text("\n".join(lines) + "\n")
    (out / "env.json").write_text(json.dumps({**env, "summary": summary}, indent=2, default=str) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("matplotlib is not installed: no hidden_shapes.png")
        return
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(results)), 4))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [r["default_ratio"] for r in results], 0.4, label="default (shipped)")
    ax.bar([x + 0.2 for x in xs], [r["autotune_ratio"] for r in results], 0.4, label="autotune")
    for y, style in ((0.9, ":"), (0.95, "--")):
        ax.axhline(y, color="grey", linestyle=style, linewidth=0.8)
    ax.set_xticks(list(xs), [r["case"].label() for r in results], rotation=90, fontsize=6)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fastest / pick")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "hidden_shapes.png", dpi=120)
    plt.close(fig)


def _env(device: torch.device) -> dict[str, Any]:
    env = (
        collect_env(device)
        if device.type == "cuda"
        else {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device),
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
    )
    spec = DeviceSpec.detect("cpu")
    env.update(
        cpu=spec.name,
        cpu_flags=sorted(spec.cpu_isa),
        shipped_fingerprint=shipped.device_fingerprint(DeviceSpec.detect(device)),
        shipped_files=shipped.describe(DeviceSpec.detect(device)),
    )
    return env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--out", type=Path, required=True, help="output directory, e.g. benchmarks/results/h100_hidden"
    )
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--quick", action="store_true", help="tiny CPU shapes (smoke test)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads on CPU (default torch's)")
    p.add_argument(
        "--kinds", nargs="+", default=None, help="only these kinds (prefill decode cross paged_decode)"
    )
    p.add_argument(
        "--max-minutes", type=float, default=6.0, help="budget in minutes, JIT pre-warm included (default 6)"
    )
    p.add_argument(
        "--prewarm-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds the JIT pre-warm may "
        "take (default min(180, 40%% of the budget); FlashInfer compiles took ~60-100 s per module on an "
        "H100 machine with 12 in parallel)",
    )
    p.add_argument(
        "--prewarm",
        type=int,
        default=None,
        metavar="N",
        help="compile JIT kernels first in N processes (default 12 on CUDA, 0 elsewhere)",
    )
    p.add_argument(
        "--exclude",
        nargs="*",
        default=None,
        help="kernel id globs not timed (default flex_attention.compiled, plus reference.* on CUDA)",
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-time-ms", type=float, default=100.0)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="time every kernel this many times, keeping each kernel's smallest round median (default 3: at "
        "~20 µs one round of torch_sdpa.cudnn read 36.5 µs, another 0.97 of flash)",
    )
    p.add_argument("--materializing-gib-max", type=float, default=2.0)
    p.add_argument(
        "--shipped-dir",
        type=Path,
        default=None,
        help="shipped timing files to use instead of the "
        "package's (e.g. the timings/ directory of a ship_timings.py --out)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status (1 with --strict when a target fails)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = open_device(args.device, "hidden_shapes", args.cpu_threads)
    if device is None:
        return 2
    cases = (
        quick_cases()
        if args.quick
        else hidden_cases(args.dtype)
        if device.type == "cuda"
        else cpu_hidden_cases()
    )
    if args.kinds:
        cases = [c for c in cases if c.kind in args.kinds]
    exclude = (
        tuple(args.exclude)
        if args.exclude is not None
        else (("flex_attention.*", "reference.*") if device.type == "cuda" else ("flex_attention.compiled",))
    )
    procs = args.prewarm if args.prewarm is not None else (12 if device.type == "cuda" else 0)
    if args.shipped_dir is not None:
        lz.configure(shipped_timings_dir=str(args.shipped_dir))
    t0, results = time.monotonic(), []
    if procs > 0:
        took, failures = prewarm_cases(
            cases, device, procs, timeout_s=args.prewarm_timeout or min(180.0, 0.4 * args.max_minutes * 60)
        )
        _say(f"prewarm: {took:.0f} s" + (f"; {len(failures)} failures" if failures else ""))
    timing = {"warmup": 2, "iters": args.iters, "repeats": args.repeats, "max_time_s": args.max_time_ms / 1e3}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lz_hidden_") as tmp:
        for i, case in enumerate(cases):
            if time.monotonic() - t0 > args.max_minutes * 60:
                _say(f"budget: stopped after {i} of {len(cases)} shapes")
                break
            try:
                r = evaluate(
                    case,
                    device,
                    timing,
                    Path(tmp),
                    i,
                    exclude=exclude,
                    materializing_gib_max=args.materializing_gib_max,
                    rounds=args.rounds,
                )
            except Exception as exc:  # noqa: BLE001 - one broken shape must not end the run
                log.warning("hidden_shapes: %s failed (%s: %s)", case.label(), type(exc).__name__, exc)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            results.append(r)
            _say(
                f"[{i + 1}/{len(cases)}] {case.label()}: default {r['default']} {r['default_ratio']:.3f}, "
                f"autotune {r['autotune']} {r['autotune_ratio']:.3f} ({r['autotune_ms']:.0f} ms), "
                f"{r['shipped_source'] or 'no shipped data'} ({time.monotonic() - t0:.0f} s)"
            )
    summary = summarize(results)
    env = _env(device)
    env.update(
        command="python benchmarks/hidden_shapes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        shapes_planned=len(cases),
        shapes_done=len(results),
        elapsed_s=round(time.monotonic() - t0, 1),
        timing=timing,
        rounds=args.rounds,
        exclude=list(exclude),
    )
    _write(args.out, results, summary, env)
    for pick, s in summary.items():
        print(
            f"{s['verdict']:<4}  {pick}: geomean {s['geomean']:.3f}, min {s['min']:.3f} ({s['worst']}); "
            f"target {s['target']}"
        )
    print(f"wrote {args.out / 'hidden_shapes.md'}, hidden_shapes.csv, env.json")
    return 1 if args.strict and any(s["verdict"] == "FAIL" for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
