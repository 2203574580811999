"""Dispatch overhead: direct ``F.scaled_dot_product_attention`` vs ``lz.attention`` on a cache hit.

Both are timed side by side in one run, interleaved in rounds (so machine load affects both alike), at a
tiny CPU shape where the kernel itself is cheap and Python overhead shows. Also times the pieces of the hot
path and rms_norm against its direct torch call. Pieces: ``Runtime.run_hot`` with a prebuilt exact key (the
lookup and the kernel call; ``lz.attention`` minus it is the exact key's checks and build), the full checks +
key (``_prepare``: what a new shape or a call with a mask pays), ``Runtime.run`` with a prebuilt key and the
sharded cache lookup; rms_norm's checks + key (``_prepare_rms``) and its bound plan.

Also the bound plan: ``lz.select(...)`` returns the cached :class:`ExecutionPlan`, callable with the op's
canonical arguments and no checks (for loops over fixed shapes). Records the CPU model, its ISA flags and
torch's CPU capability (``ATEN_CPU_CAPABILITY`` changes what torch dispatches to).

Usage: ``python benchmarks/bench_dispatch.py [--rounds 15] [--iters 2000] [--out
benchmarks/results/dispatch.md]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import layerzero as lz
import layerzero.telemetry as lzt
from layerzero.core.device import DeviceSpec
from layerzero.core.runtime import RUNTIME

_attn = importlib.import_module("layerzero.ops.attention")
_norms = importlib.import_module("layerzero.ops.norms")


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def per_call_us(fn: Callable[[], object], iters: int) -> float:
    """Mean µs per call over ``iters`` calls."""
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter_ns() - t0) / iters / 1e3


def measure(pairs: dict[str, Callable[[], object]], rounds: int, iters: int) -> dict[str, float]:
    """Median over rounds of each callable's per-call µs; callables are interleaved within each round. Names
    ending in ``(telemetry on)`` run with ``layerzero.telemetry`` recording (default sampling), the others
    off."""
    samples: dict[str, list[float]] = {name: [] for name in pairs}
    for r in range(rounds + 1):  # round 0 warms up
        for name, fn in pairs.items():
            if name.endswith("(telemetry on)"):
                lzt.enable()
            us = per_call_us(fn, 200 if r == 0 else iters)
            lzt.disable()
            if r:
                samples[name].append(us)
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print a markdown table and optionally write it to ``--out``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--device", default="cpu", help="cpu or cuda (CUDA calls are timed as launches, then synced)"
    )
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    lz.configure(use_perfdb=False)
    g = torch.Generator().manual_seed(0)
    dev = torch.device(ns.device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(1, 8, 16, 64, generator=g).to(dev, dtype) for _ in range(3))
    x, w = torch.randn(4, 64, generator=g).to(dev, dtype), torch.ones(64, device=dev, dtype=dtype)
    key, args = _attn._prepare(q, k, v, None, False, None, 0.0, "BHSD")
    for _ in range(2):  # the first call selects, the second files the hot keys
        lz.attention(q, k, v)
        lz.rms_norm(x, w)
    kernel = lz.which("attention", q, k, v)
    plan = lz.select("attention", q, k, v)  # the bound plan: canonical args, no checks
    rms_plan = lz.select("rms_norm", x, w)
    exact = [k_ for k_ in RUNTIME.cache.hot if len(k_) > 3 and k_[0] == "attention" and k_[3] == q.shape]
    if len(exact) != 1:
        raise SystemExit(f"expected one exact attention key in the hot dict, found {len(exact)}")
    hot_key = exact[0]
    rkey, rargs = _norms._prepare_rms(x, w, 1e-6, None)
    res = measure(
        {
            "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v),
            "lz.attention (cache hit)": lambda: lz.attention(q, k, v),
            "lz.attention (cache hit, telemetry on)": lambda: lz.attention(q, k, v),
            "  run_hot, prebuilt exact key": lambda: RUNTIME.run_hot(hot_key, args),
            "  full checks + key (_prepare; new shape, mask)": lambda: _attn._prepare(
                q, k, v, None, False, None, 0.0, "BHSD"
            ),
            "  Runtime.run, prebuilt key": lambda: RUNTIME.run(key, _attn.context, args),
            "  cache lookup (sharded)": lambda: RUNTIME.cache.get(key),
            "bound plan (lz.select(...)(*args))": lambda: plan(*args),
            "F.rms_norm": lambda: F.rms_norm(x, (64,), w, 1e-6),  # noqa: E731
            "lz.rms_norm (cache hit)": lambda: lz.rms_norm(x, w),
            "lz.rms_norm (cache hit, telemetry on)": lambda: lz.rms_norm(x, w),
            "  rms checks + key (_prepare_rms)": lambda: _norms._prepare_rms(x, w, 1e-6, None),
            "  Runtime.run, prebuilt key (rms)": lambda: RUNTIME.run(rkey, _norms.context_rms, rargs),
            "bound rms plan": lambda: rms_plan(*rargs),
        },
        ns.rounds,
        ns.iters,
    )
    overhead = res["lz.attention (cache hit)"] - res["F.scaled_dot_product_attention"]
    ratio = res["lz.attention (cache hit)"] / res["F.scaled_dot_product_attention"]
    rms_over = res["lz.rms_norm (cache hit)"] - res["F.rms_norm"]
    bound_over = res["bound plan (lz.select(...)(*args))"] - res["F.scaled_dot_product_attention"]
    rms_bound_over = res["bound rms plan"] - res["F.rms_norm"]
    tele = res["lz.attention (cache hit, telemetry on)"] - res["lz.attention (cache hit)"]
    rms_tele = res["lz.rms_norm (cache hit, telemetry on)"] - res["lz.rms_norm (cache hit)"]
    isa = sorted(DeviceSpec.detect("cpu").cpu_isa)
    cap = torch.backends.cpu.get_cpu_capability()
    target = 3.0 if "avx512" in isa and cap.upper().startswith("AVX512") else 5.0
    lines = [
        f"# Dispatch overhead ({ns.device}, cache hit)",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {platform.machine()} {_cpu_model()} ({torch.get_num_threads()} torch thread), "
        f"python {platform.python_version()}, torch {torch.__version__}, layerzero {lz.__version__}",
        f"- CPU flags: {', '.join(isa)}; torch CPU capability: {cap} "
        f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')})",
        f"- shape: q/k/v [1, 8, 16, 64] {str(dtype).removeprefix('torch.')} (BHSD) on {dev}; chosen kernel: "
        f"{kernel}",
        f"- method: median over {ns.rounds} interleaved rounds of {ns.iters} calls each",
        "",
        "| call | µs per call |",
        "| --- | ---: |",
        *[f"| {name} | {us:.2f} |" for name, us in res.items()],
        "",
        f"**attention overhead: {overhead:.2f} µs per call (ratio lz/SDPA {ratio:.3f})**; rms_norm overhead: "
        f"{rms_over:.2f} µs. Target: <= {target:g} µs on this CPU (5 µs AVX2, 3 µs AVX-512).",
        f"**bound plan overhead: {bound_over:.2f} µs per call** (rms_norm: {rms_bound_over:.2f} µs; "
        "target <= 1 µs).",
        f"**telemetry on: +{tele:.2f} µs per attention call** (rms_norm: +{rms_tele:.2f} µs; target <= 0.2 "
        "µs; one call in 64 timed).",
    ]
    text = "\n".join(lines)
    print(text)
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
