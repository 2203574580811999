"""Launch-config search for ``triton.paged_decode`` on the sweep's paged-decode shapes (a GPU script).

For each shape of ``benchmarks/_sweep_shapes.full_shapes()`` with phase ``paged_decode`` (the same inputs the
sweep builds: seq_lens in ``[0.75, 1] * Skv``, scattered pages of 16), side by side in one run:

1. the copy of the KV bytes read (the bandwidth yardstick of the sweep), FlashInfer's paged decode when it
   imports, and ``triton.paged_decode`` with its default launch config;
2. a coordinate search: every (num_splits, block_n) at the default warps/stages, then every (num_warps,
   num_stages) at the best of those. Every config's output is compared with the default config's (which the
   GPU tests check against float64) before it is timed.

Timing is the sweep's (``lz.tune``'s harness: CUDA events, median after outlier removal); the Triton configs
are replayed from a CUDA graph of 10 calls (kernel time: eager calls of small shapes measure host launch
time), the copy and FlashInfer (not graph-safe) run eagerly. Usage::

    PYTHONPATH=src:benchmarks python benchmarks/tune_paged_decode.py --out results/paged_decode_tuning

writes ``configs.csv`` (every config timed) and ``summary.md`` (per shape: default vs best config vs
FlashInfer, GB/s vs copy). The split heuristic in ``layerzero.backends.triton.paged`` follows these numbers.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import platform
import time
from pathlib import Path
from typing import Any

import torch
from _sweep_measure import copy_callee, graph_callee
from _sweep_shapes import build_inputs, full_shapes

import layerzero as lz
from layerzero.backends.triton import paged
from layerzero.core.report import CandidateStatus
from layerzero.core.runtime import RUNTIME
from layerzero.ops import OPS
from layerzero.tuning import bind, sample_stats, time_kernel

FLASHINFER = "flashinfer.paged_attention"


def _time(fn, device: torch.device, graph: bool = False) -> float:
    """Median µs per call of ``fn()`` (sweep settings: 3 warm-up calls, samples of 10 calls). ``graph``:
    replay ``fn`` captured 10 times in one CUDA graph (kernel time without host launch overhead, as decode is
    served)."""
    if not graph:
        return sample_stats(
            time_kernel(fn, (), device, warmup=3, iters=10, repeats=10, max_time_s=0.25)
        ).median_us
    callee = graph_callee({}, fn, device)
    samples = time_kernel(callee.fn, (), device, warmup=3, iters=5, repeats=10, max_time_s=0.25)
    return sample_stats([x / callee.calls for x in samples]).median_us


def _flashinfer(inputs) -> Any:
    """FlashInfer's paged decode bound bare like the sweep binds kernels (plan cached), or None when it is not
    eligible here (not installed, or refused by its constraints)."""
    report = lz.explain("paged_attention", *inputs.args, **inputs.kwargs)
    ids = {c.kernel_id for c in report.candidates if c.status is not CandidateStatus.REJECTED}
    if FLASHINFER not in ids:
        return None
    _, canonical = OPS["paged_attention"][0](*inputs.args, **inputs.kwargs)
    fn = bind(RUNTIME.registry, RUNTIME.registry.kernel(FLASHINFER, "paged_attention"), report.context)
    return lambda: fn(*canonical)


def search(shape, device: torch.device, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Time the copy, FlashInfer, the default config and the coordinate search for one shape; append one CSV
    row per config to ``rows``; return the summary row."""
    inputs = build_inputs(shape, device)
    q, cache, table, lens = inputs.args
    kv = inputs.kv_bytes
    copy = copy_callee(shape, 0, inputs)  # the sweep's yardstick: the KV bytes read, copied
    copy_us = _time(lambda: copy.fn(*copy.args), device)
    fi = _flashinfer(inputs)
    fi_us = _time(fi, device) if fi is not None else None
    ref = paged.paged_decode(q, cache, table, lens)
    d = shape.head_dim
    default_bn = paged.block_n_for(d, q.element_size())
    max_kv = table.shape[1] * shape.page
    default_split = paged.choose_split_len(
        shape.batch, shape.hkv, max_kv, paged.sm_count(device), default_bn
    )[1]

    def run(splits: int, bn: int, warps: int | None, stages: int | None) -> float | None:
        fn = lambda: paged.paged_decode(  # noqa: E731
            q,
            cache,
            table,
            lens,
            num_splits=splits,
            block_n=bn,  # noqa: E731
            num_warps=warps,
            num_stages=stages,
        )
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: recorded, not fatal)
            rows.append(
                dict(
                    shape=shape.label(),
                    splits=splits,
                    block_n=bn,
                    warps=warps,
                    stages=stages,
                    us="",
                    gbps="",
                    error=f"{type(exc).__name__}: {str(exc)[:120]}",
                )
            )
            return None
        err = float(((out.float() - ref.float()).abs() / (1 + ref.float().abs())).max())
        us = _time(fn, device, graph=True)
        rows.append(
            dict(
                shape=shape.label(),
                splits=splits,
                block_n=bn,
                warps=warps,
                stages=stages,
                us=round(us, 2),
                gbps=round(kv / us / 1e3, 1),
                error=f"max rel diff {err:.2e}" if err > 2e-2 else "",
            )
        )
        return None if err > 2e-2 else us

    default_us = run(default_split, default_bn, None, None)
    tiles = -(-max_kv // 16)
    split_opts = [s for s in (1, 2, 3, 4, 6, 8, 16, 32) if s <= tiles]
    bn_opts = [bn for bn in (16, 32, 64, 128) if not (bn == 128 and d > 128)]
    best = (default_us or float("inf"), default_split, default_bn, None, None)
    for splits, bn in itertools.product(split_opts, bn_opts):
        if (splits, bn) == (default_split, default_bn):
            continue  # timed above
        us = run(splits, bn, None, None)
        if us is not None and us < best[0]:
            best = (us, splits, bn, None, None)
    for warps, stages in itertools.product((2, 4, 8), (1, 2, 3, 4)):
        us = run(best[1], best[2], warps, stages)
        if us is not None and us < best[0]:
            best = (us, best[1], best[2], warps, stages)
    us, splits, bn, warps, stages = best
    return dict(
        shape=shape.label(),
        kv_mb=round(kv / 1e6, 1),
        copy_gbps=round(2 * kv / copy_us / 1e3),
        flashinfer_us=round(fi_us, 1) if fi_us else "",
        default=f"S{default_split} N{default_bn}",
        default_us=round(default_us, 1) if default_us else "",
        best=f"S{splits} N{bn} W{warps} st{stages}",
        best_us=round(us, 1),
        best_vs_copy=round(kv / us / 1e3 / (2 * kv / copy_us / 1e3), 3),
        default_vs_copy=round(copy_us / 2 / default_us, 3) if default_us else "",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (configs.csv, summary.md)")
    ap.add_argument("--min-batch", type=int, default=1, help="only shapes with B >= this")
    ap.add_argument("--max-minutes", type=float, default=8.0, help="stop starting new shapes after this")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in full_shapes() if s.phase == "paged_decode" and s.batch >= args.min_batch]
    rows: list[dict[str, Any]] = []
    summary = []
    t0 = time.perf_counter()
    for s in shapes:
        if time.perf_counter() - t0 > 60 * args.max_minutes:
            print(f"budget spent; skipped {s.label()}")
            continue
        summary.append(search(s, device, rows))
        print(summary[-1], flush=True)
        torch.cuda.empty_cache()
    with open(args.out / "configs.csv", "w", newline="") as f:
        w = csv.DictWriter(
            f, fieldnames=["shape", "splits", "block_n", "warps", "stages", "us", "gbps", "error"]
        )
        w.writeheader()
        w.writerows(rows)
    import triton

    head = (
        "# triton.paged_decode launch-config search\n\n"
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} on {torch.cuda.get_device_name()} "
        f"({paged.sm_count(device)} SMs), torch {torch.__version__}, Triton {triton.__version__}, Python "
        f"{platform.python_version()}. Times in µs (median); S = splits, N = block_n, W = warps, st = stages "
        "(None: default). vs copy = (KV bytes / time) / (copy GB/s).\n\n"
    )
    cols = list(summary[0]) if summary else []
    table = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    table += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in summary]
    (args.out / "summary.md").write_text(head + "\n".join(table) + "\n")
    print(head + "\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
