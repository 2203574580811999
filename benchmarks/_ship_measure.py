"""Measure one :class:`~_ship_grid.Case`: every eligible kernel checked against the reference and timed, with
the harness ``lz.tune`` uses (``layerzero.tuning.autotune.measure_context``: same eligibility, check and
``time_kernel``); plus the JIT pre-warm workers of ``ship_timings.py`` / ``hidden_shapes.py``.

Worker: ``python benchmarks/_ship_measure.py <device> '<json list of cases>'`` calls every eligible kernel of
each (tiny) case once (FlashInfer / Triton compile on first use; the compiled modules land in their on-disk
caches).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ship_grid import Case, build, scores_bytes  # noqa: E402

from layerzero.core.context import SelectionContext  # noqa: E402
from layerzero.core.runtime import RUNTIME  # noqa: E402
from layerzero.core.selection import bind  # noqa: E402
from layerzero.ops import OPS  # noqa: E402
from layerzero.tuning.autotune import eligible_kernels, measure_context  # noqa: E402
from layerzero.tuning.report import TuneRow, TuneStatus  # noqa: E402

__all__ = ["MATERIALIZING", "Measured", "measure_case", "measure_rounds", "prepare_case", "prewarm_cases"]

MATERIALIZING = ("reference.*", "torch_sdpa.math", "flex_attention.attention")
"""Kernels that build the whole float32 score matrix: left out above ``materializing_gib_max``."""


@dataclass
class Measured:
    """One measured case: its context and one row per eligible kernel (µs). It holds no tensors: a run keeps
    every measured case, and keeping their inputs (GiB-sized KV caches) ran an H200 out of memory after ~470
    cases."""

    case: Case
    ctx: SelectionContext
    rows: list[TuneRow]
    samples: dict[str, tuple[float, ...]] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()

    def ok(self) -> dict[str, float]:
        """Kernel id -> median µs of the kernels that passed the check and were timed."""
        return {
            r.kernel_id: r.median_us
            for r in self.rows
            if r.status is TuneStatus.OK and r.median_us is not None
        }

    def fastest(self) -> tuple[str, float] | None:
        """(kernel id, median µs) of the fastest correct kernel, or None."""
        ok = self.ok()
        return None if not ok else min(ok.items(), key=lambda kv: kv[1])


def prepare_case(case: Case, device: torch.device) -> tuple[SelectionContext, tuple[Any, ...]]:
    """(context, canonical kernel args) of ``case``'s call, built exactly as ``lz.<op>`` builds them."""
    args, kwargs = build(case, device)
    prepare, build_ctx = OPS[case.op]
    key, canonical = prepare(*args, **kwargs)
    return build_ctx(key), canonical


def measure_case(
    case: Case,
    device: torch.device,
    timing: dict[str, Any],
    exclude: tuple[str, ...] = (),
    materializing_gib_max: float = 2.0,
) -> Measured:
    """Check and time every eligible kernel of ``case`` (``timing``: ``warmup``, ``iters``, ``repeats``,
    ``max_time_s``); kernels matching ``exclude`` are not run, nor the materializing ones when the score
    matrix is over ``materializing_gib_max`` GiB (the reference output is then computed in chunks). Exceptions
    of the reference kernel and of input allocation propagate."""
    ctx, canonical = prepare_case(case, device)
    skip = tuple(exclude) + (MATERIALIZING if scores_bytes(case) > materializing_gib_max * (1 << 30) else ())
    results = measure_context(RUNTIME, ctx, canonical, exclude=skip, **timing)
    rows = [r for r, _ in results]
    return Measured(case, ctx, rows, {r.kernel_id: kept for r, kept in results}, skip)


def measure_rounds(
    case: Case,
    device: torch.device,
    timing: dict[str, Any],
    exclude: tuple[str, ...],
    materializing_gib_max: float,
    rounds: int,
) -> Measured:
    """``measure_case`` ``rounds`` times; a kernel's median is the smallest of its rounds' medians (a busy
    machine only ever slows a round down), and a kernel that failed in any round keeps its failed row."""
    ms = [measure_case(case, device, timing, exclude, materializing_gib_max) for _ in range(max(1, rounds))]
    first = ms[0]
    if len(ms) == 1:
        return first
    rows = []
    for row in first.rows:
        same = [next((r for r in m.rows if r.kernel_id == row.kernel_id), None) for m in ms]
        bad = next((r for r in same if r is None or r.status is not TuneStatus.OK), None)
        if bad is not None or row.status is not TuneStatus.OK:
            rows.append(row if bad is None else bad)
            continue
        best = min(same, key=lambda r: r.median_us)
        rows.append(replace(best, samples=sum(r.samples for r in same)))
    first.rows = rows
    return first


def prewarm_cases(
    cases: list[Case], device: torch.device, procs: int, timeout_s: float = 180.0
) -> tuple[float, list[str]]:
    """Compile the JIT kernels of ``cases`` before timing: one tiny case per distinct JIT signature, dealt
    over ``procs`` worker processes (each imports torch once and runs its share;
    ``_sweep_prewarm.run_workers``). The compiled modules land in FlashInfer's / Triton's on-disk caches.
    Returns (seconds, failure messages)."""
    from _sweep_prewarm import run_workers

    seen: dict[tuple[Any, ...], Case] = {}
    for c in cases:
        seen.setdefault(c.signature, c.tiny())
    tiny = list(seen.values())
    n = max(1, min(procs, len(tiny)))
    commands = [
        [sys.executable, __file__, str(device), json.dumps([c.to_dict() for c in tiny[i::n]])]
        for i in range(n)
    ]
    return run_workers(commands, n, timeout_s)


def _worker(device_name: str, spec: str) -> int:
    """Call every eligible kernel (except reference and compiled flex) of each tiny case once; print
    failures."""
    device = torch.device(device_name)
    bad = 0
    for case in (Case(**d) for d in json.loads(spec)):
        ctx, canonical = prepare_case(case, device)
        for kernel in eligible_kernels(RUNTIME, ctx, exclude=("reference.*", "flex_attention.*")):
            try:
                bind(RUNTIME.registry, kernel, ctx)[0](*canonical)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported; the measurement records the kernel's failure itself
                bad += 1
                print(f"{case.label()} {kernel.kernel_id}: {type(exc).__name__}: {str(exc)[:200]}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("LAYERZERO_SHIPPED_TIMINGS", "0")
    sys.exit(_worker(sys.argv[1], sys.argv[2]))
