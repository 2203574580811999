"""Host overhead of ``lz.quantized_linear`` on a cache hit, side by side with ``lz.linear`` and the direct
calls.

At a tiny CPU shape (x ``[4, 64]`` float32, weight ``[32, 64]``; the kernels are cheap, so Python shows), per
weight format (int8 per channel, int4 groups of 32): the chosen kernel called directly (the plan's function:
``torch_native.quantized_linear``), ``lz.quantized_linear`` as it is (a weight's metadata checked once, its
tensors every call: ``ops/quantized_linear.py``'s ``_WEIGHTS``), the same with the memo bypassed (a miss: the
full checks, plus computing and filing the weight's layout), the same with a new ``QuantizedTensor`` built per
call (what the engine's layers do), and the pieces (``_prepare``, the op's checks + key, both ways;
``Runtime.run`` with a prebuilt key). ``--before FILE`` adds the rows of another version of
``ops/quantized_linear.py`` (its ``quantized_linear`` and ``prepare``, the checks + key its op ran), e.g. of
the last commit: ``git show HEAD:src/layerzero/ops/quantized_linear.py >
/tmp/ql_before.py``; timed in the same run. For comparison ``F.linear`` and ``lz.linear`` on the float weight
of the same shape. Every row is timed in the same run, interleaved in rounds (machine load affects all alike);
the memo is bypassed only while its own rows run. Records the machine, the CPU's model and ISA flags
(/proc/cpuinfo), torch and the date.

Usage: ``PYTHONPATH=src python benchmarks/bench_quantized_linear_overhead.py [--rounds 15] [--iters 2000]
[--before FILE] [--out benchmarks/results/quantized_linear_overhead_cpu.md]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import platform
import statistics
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from bench_dispatch import _cpu_model, per_call_us

import layerzero as lz
from layerzero.core.runtime import RUNTIME

ql = importlib.import_module("layerzero.ops.quantized_linear")  # the module (lz.quantized_linear is the op)
_lin = importlib.import_module("layerzero.ops.linear")
FULL = " [memo bypassed]"
"""Rows whose name ends with this run with the memo bypassed (``_fast_weight`` always misses)."""


def _cpu_flags() -> list[str]:
    """The SIMD flags of /proc/cpuinfo's first ``flags`` line that matter to torch's CPU kernels."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    keep = ("avx", "fma", "f16c", "amx", "sse4", "vnni", "bf16")
                    return [w for w in line.split(":", 1)[1].split() if w.startswith(keep)]
    except OSError:
        pass
    return []


def measure(rows: dict[str, Callable[[], object]], rounds: int, iters: int) -> dict[str, float]:
    """Median over rounds of each row's per-call µs; rows interleaved within each round; rows named
    ``...FULL`` run with ``ql._fast_weight`` replaced by a function that always misses (every call takes the
    full checks)."""
    fast = ql._fast_weight
    samples: dict[str, list[float]] = {name: [] for name in rows}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for name, fn in rows.items():
                if name.endswith(FULL):
                    ql._fast_weight = lambda x, qt, bias: None
                us = per_call_us(fn, 200 if r == 0 else iters)
                ql._fast_weight = fast
                if r:
                    samples[name].append(us)
    finally:
        ql._fast_weight = fast
    return {name: statistics.median(v) for name, v in samples.items()}


def _load_before(path: str) -> ModuleType:
    """Another version of ``ops/quantized_linear.py`` as a sibling module of the real one (its relative
    imports resolve in ``layerzero.ops``); its keys equal the real keys, so it hits the same cache entries."""
    spec = importlib.util.spec_from_file_location("layerzero.ops._quantized_linear_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(
    tag: str, x: torch.Tensor, qt: lz.QuantizedTensor, b: torch.Tensor, before: Any
) -> dict[str, Callable[[], object]]:
    for _ in range(2):  # the first call selects, the second files the hot key
        lz.quantized_linear(x, qt, b)
    plan = lz.select("quantized_linear", x, qt, b)
    key, args = ql.prepare(x, qt, b)
    fields = tuple(qt)
    old = (
        {}
        if before is None
        else {
            f"{tag}: lz.quantized_linear (cache hit) [before]": lambda: before.quantized_linear(x, qt, b),
            f"{tag}:   checks + key (prepare) [before]": lambda: before.prepare(x, qt, b),
        }
    )
    return {
        **old,
        f"{tag}: kernel direct ({plan.kernel_id})": lambda: plan.call(x, qt, b),
        f"{tag}: lz.quantized_linear (cache hit)": lambda: lz.quantized_linear(x, qt, b),
        f"{tag}: lz.quantized_linear (cache hit){FULL}": lambda: lz.quantized_linear(x, qt, b),
        f"{tag}: lz.quantized_linear, new QuantizedTensor per call": lambda: lz.quantized_linear(
            x, lz.QuantizedTensor(*fields), b
        ),
        f"{tag}:   checks + key (_prepare)": lambda: ql._prepare(x, qt, b),
        f"{tag}:   checks + key (_prepare){FULL}": lambda: ql._prepare(x, qt, b),
        f"{tag}:   Runtime.run, prebuilt key": lambda: RUNTIME.run(key, ql.context, args),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print a markdown table and optionally write it to ``--out``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--before", default=None, help="another ops/quantized_linear.py to time side by side")
    ns = ap.parse_args(argv)
    before = None if ns.before is None else _load_before(ns.before)
    torch.set_num_threads(1)
    lz.configure(use_perfdb=False)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
    for _ in range(2):
        lz.linear(x, w, b)
    formats = {"int8": lz.quantize(w, "int8", axis=0), "int4": lz.quantize(w, "int4", group_size=32)}
    rows: dict[str, Callable[[], object]] = {
        "F.linear (float weight)": lambda: F.linear(x, w, b),
        "lz.linear (cache hit)": lambda: lz.linear(x, w, b),
        "  lz.linear checks + key (prepare)": lambda: _lin.prepare(x, w, b),
    }
    for tag, qt in formats.items():
        rows.update(_rows(tag, x, qt, b, before))
    res = measure(rows, ns.rounds, ns.iters)
    cap = torch.backends.cpu.get_cpu_capability()
    lin_over = res["lz.linear (cache hit)"] - res["F.linear (float weight)"]
    summary = []
    for tag in formats:
        direct = next(us for name, us in res.items() if name.startswith(f"{tag}: kernel direct"))
        after = res[f"{tag}: lz.quantized_linear (cache hit)"] - direct
        miss = res[f"{tag}: lz.quantized_linear (cache hit){FULL}"] - direct
        old = (
            ""
            if before is None
            else (
                f"; before: {res[f'{tag}: lz.quantized_linear (cache hit) [before]'] - direct:.2f} µs, its "
                f"checks + key {res[f'{tag}:   checks + key (prepare) [before]']:.2f} µs"
            )
        )
        summary.append(
            f"- **{tag}: lz.quantized_linear over the direct kernel call {after:.2f} µs per call, "
            f"checks + key {res[f'{tag}:   checks + key (_prepare)']:.2f} µs{old}**; memo bypassed "
            f"(every call a miss): {miss:.2f} µs, checks + key "
            f"{res[f'{tag}:   checks + key (_prepare){FULL}']:.2f} µs"
        )
    lines = [
        "# lz.quantized_linear host overhead (cpu, cache hit)",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {platform.machine()} {_cpu_model()}, {os.cpu_count()} CPUs ({torch.get_num_threads()} "
        f"torch thread), python {platform.python_version()}, torch {torch.__version__}, layerzero "
        f"{lz.__version__}",
        f"- CPU flags (/proc/cpuinfo): {' '.join(_cpu_flags()) or 'unknown'}; torch CPU capability: {cap} "
        f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')})",
        "- shape: x [4, 64] float32, weight [32, 64] (int8 per channel; int4 groups of 32), bias [32], on "
        "cpu",
        f"- method: median over {ns.rounds} interleaved rounds of {ns.iters} calls each; rows marked{FULL} "
        "make every call a memo miss (the full checks, then the layout computed and filed)"
        + ("" if before is None else f"; rows marked [before]: {ns.before}"),
        "",
        "| call | µs per call |",
        "| --- | ---: |",
        *[f"| {name} | {us:.2f} |" for name, us in res.items()],
        "",
        f"- lz.linear over F.linear: {lin_over:.2f} µs per call; its checks + key "
        f"{res['  lz.linear checks + key (prepare)']:.2f} µs",
        *summary,
    ]
    text = "\n".join(lines)
    print(text)
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
