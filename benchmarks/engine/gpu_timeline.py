"""A GPU timeline from torch.profiler: busy and idle time, the largest idle gaps with the GPU ops either
side, the GPU ops by the busy time they add, and the CUDA runtime calls (``batch1_ab.py``'s decode step, and
``bench_spec_decode.py --timeline``'s speculative rounds). ``summarize`` reads a chrome trace's events and
needs no GPU (``tests/unit/test_gpu_timeline.py`` checks it on a hand-made trace)."""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

__all__ = ["profile_events", "summarize"]


def profile_events(run: Callable[[], object]) -> list[dict]:
    """The chrome-trace events of ``run()`` under torch.profiler (CPU and CUDA activities)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return json.loads(trace.read_text())["traceEvents"]


def summarize(events: list[dict], what: str = "a 64-token generate", steps: int = 64) -> str:
    """The markdown summary of a chrome trace's ``events`` (``traceEvents`` of ``export_chrome_trace``): the
    GPU span, busy and idle time (µs in the trace, ms in the text), the largest idle gaps with the GPU ops
    either side, GPU ops by the busy time they add (per call and per step: ``steps`` steps or rounds in
    the profiled ``what``), the ops repeated between two split merges, and the CUDA runtime calls."""
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    if not gpu:
        return f"## GPU timeline of {what}\n\nNo GPU ops in the trace (a CPU run).\n"
    gaps, busy, end, prev = [], 0.0, None, None
    per_kernel: dict[str, list[float]] = defaultdict(
        lambda: [0, 0.0, 0.0]
    )  # calls, duration, timeline extension
    # the same per (name, its ordinal since the last split merge): a layer's four projections share one kernel
    # name (after the merge: o, gate/up, down, then the next layer's qkv; the very first qkv counts as an o)
    per_slot: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    since_merge: dict[str, int] = defaultdict(int)
    for e in gpu:
        s, d = float(e["ts"]), float(e["dur"])
        if end is not None and s > end:
            gaps.append((s - end, prev, e["name"]))
        if e["name"] == "paged_decode_merge":
            since_merge.clear()
        since_merge[e["name"]] += 1
        rows = (per_kernel[e["name"]], per_slot[(e["name"], since_merge[e["name"]])])
        ext = 0.0
        if end is None or s + d > end:
            ext = (s + d) - max(
                s, end if end is not None else s
            )  # busy time this op adds beyond the ones before it
            busy += ext
            end, prev = s + d, e["name"]
        for row in rows:
            row[0] += 1
            row[1] += d
            row[2] += ext
    span = float(gpu[-1]["ts"]) + float(gpu[-1]["dur"]) - float(gpu[0]["ts"])
    idle = sum(g for g, _, _ in gaps)
    big = sorted(gaps, reverse=True)[:15]
    by_call: dict[str, list[float]] = defaultdict(list)
    for e in runtime:
        by_call[e["name"]].append(float(e["dur"]))
    calls = sorted(by_call.items(), key=lambda kv: -sum(kv[1]))[:12]
    hist = defaultdict(float)
    for g, _, _ in gaps:
        hist["< 2 µs" if g < 2 else "2-10 µs" if g < 10 else "10-50 µs" if g < 50 else ">= 50 µs"] += g
    lines = [
        f"## GPU timeline of {what} (torch.profiler; the profiler adds ~1 µs per kernel)",
        "",
        f"- span {span / 1000:.1f} ms over {len(gpu)} GPU ops: busy {busy / 1000:.1f} ms, idle "
        f"{idle / 1000:.1f} ms in {len(gaps)} gaps; idle by gap size: "
        + ", ".join(f"{k} {v / 1000:.2f} ms" for k, v in hist.items()),
        "",
        "| gap µs | after | before |",
        "| ---: | --- | --- |",
    ]
    lines += [f"| {g:.1f} | {a[:60]} | {b[:60]} |" for g, a, b in big]
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1][2])[:25]
    lines += [
        "",
        "GPU ops by the busy time they add (an op overlapping the one before it under PDL adds only what "
        f"runs past that one's end; per step = over the whole run / {steps}):",
        "",
        "| op | calls | mean µs | busy added per call µs | busy added per step µs |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {k[:70]} | {int(n)} | {dur / n:.2f} | {ext / n:.2f} | {ext / steps:.1f} |"
        for k, (n, dur, ext) in kernels
    ]
    repeated = sorted(k for k in per_slot if k[1] > 1 or (k[0], 2) in per_slot)
    lines += [
        "",
        "Ops that run more than once between two split merges, by their ordinal since the last merge (the "
        "projections: 1 o, 2 gate/up, 3 down, 4 the next layer's qkv):",
        "",
        "| op | ordinal | calls | mean µs | busy added per call µs |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {k[:60]} | {i} | {int(per_slot[(k, i)][0])} | {per_slot[(k, i)][1] / per_slot[(k, i)][0]:.2f} | "
        f"{per_slot[(k, i)][2] / per_slot[(k, i)][0]:.2f} |"
        for k, i in repeated
    ]
    lines += [
        "",
        "| runtime call | calls | total ms | median µs | max µs |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {k} | {len(v)} | {sum(v) / 1000:.2f} | {statistics.median(v):.1f} | {max(v):.1f} |"
        for k, v in calls
    ]
    return "\n".join(lines) + "\n"
