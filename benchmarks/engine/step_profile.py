"""Where a throughput run's wall time goes, by step kind: ``layerzero bench-engine``'s workload (nano-vllm's)
run ``--runs`` times in one process (the first includes first-use JIT compiles; the prefix cache is emptied
between runs). Each step's wall time (between two ``EngineStats.record`` calls) is binned by kind (steps with
prefill tokens; decode steps by batch size), and the kernels each op ran are listed (``layerzero.telemetry``
call counts; graph replays do not count). Diagnoses a throughput number far from the expected one.

Usage: ``PYTHONPATH=src python benchmarks/engine/step_profile.py --out DIR [--runs 2] [--requests
256]`` (CUDA). Writes ``DIR/step_profile.md``."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import layerzero.telemetry as lzt
from layerzero.engine import LLM, SamplingParams
from layerzero.engine.metrics import EngineStats
from layerzero.engine.tools.bench import default_checkpoint, make_workload

BINS = ((0, 0), (1, 1), (2, 8), (9, 32), (33, 128), (129, 256))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--scale", choices=("full", "cpu"), default="full")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    w = make_workload(a.scale)
    prompts, max_tokens = w.prompts[: a.requests], w.max_tokens[: a.requests]
    dt = torch.bfloat16 if a.device == "cuda" else torch.float32
    llm = LLM(
        default_checkpoint(a.scale, dt),
        device=a.device,
        dtype=dt,
        max_model_len=max(len(p) for p in w.prompts) + max(w.max_tokens) + 16,
    )
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    steps: list[
        tuple[int, int, float]
    ] = []  # (prefill tokens, decode rows, wall seconds since the last record)
    real = EngineStats.record
    last = [time.perf_counter()]

    def record(self, step, *args, **kw):
        now = time.perf_counter()
        steps.append((step.num_prefill_tokens, step.num_decode_tokens, now - last[0]))
        last[0] = now
        return real(self, step, *args, **kw)

    EngineStats.record = record
    lines = [f"# Throughput run by step kind ({a.device}, {a.scale} scale)", ""]
    lzt.enable()
    for run in range(a.runs):
        if (
            run and not llm.engine.kv.reset_prefix_cache()
        ):  # the same prompts again: no prefix hits from the last run
            raise RuntimeError("could not empty the prefix cache between runs")
        steps.clear()
        lzt.reset()
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = last[0] = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - t0
        out_tokens = sum(max_tokens)
        lines += [
            f"## run {run + 1}: {out_tokens / took:.0f} output tok/s ({took:.2f} s, {len(steps)} steps)",
            "",
            "| steps | count | wall s | median ms | max ms |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        kinds = {"with prefill tokens": [s for s in steps if s[0]]}
        for lo, hi in BINS[1:]:
            kinds[f"decode, {lo}-{hi} rows"] = [s for s in steps if not s[0] and lo <= s[1] <= hi]
        for name, ss in kinds.items():
            if ss:
                ws = [s[2] for s in ss]
                lines.append(
                    f"| {name} | {len(ss)} | {sum(ws):.2f} | {1e3 * statistics.median(ws):.2f} | "
                    f"{1e3 * max(ws):.2f} |"
                )
        slow = sorted(steps, key=lambda s: -s[2])[:8]
        lines += [
            "",
            "slowest steps (prefill tokens, decode rows, ms): "
            + ", ".join(f"({p}, {d}, {1e3 * t:.1f})" for p, d, t in slow),
            "",
            "kernel calls:",
            "",
        ]
        snap = lzt.snapshot()
        for kernel, (op, n) in sorted(snap["calls"].items(), key=lambda kv: -kv[1][1])[:24]:
            lines.append(f"- {op}: {kernel} x {n}")
        lines += [f"- fallback {k} x {n}" for k, n in snap["fallbacks"].items()]
        lines.append("")
        print("\n".join(lines[-40:]), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "step_profile.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
