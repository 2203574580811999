"""CPU ISA routing: do LayerZero's CPU kernels rank differently on CPUs with fewer ISA features?

One run measures every CPU kernel LayerZero has for attention (``torch_sdpa.flash`` = torch's CPU flash
kernel, ``torch_sdpa.math``, ``reference.attention``), rms_norm and layer_norm (``torch_native``,
``reference``), plus two candidates that do not exist as kernels (a float32-upcast attention for bf16/fp16
inputs, and math attention with oneDNN switched off through ``torch.backends.mkldnn.flags(enabled=False)``),
in bf16, fp16 and fp32, under several emulated CPUs. Each emulated CPU is a fresh subprocess with:

- ``native``: no override (this CPU: AVX-512 with avx512_bf16, torch capability AVX512);
- ``avx512_nobf16``: ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` (oneDNN may not use avx512_bf16/AMX: a Skylake-X);
- ``avx2``: ``ATEN_CPU_CAPABILITY=avx2`` and ``ONEDNN_MAX_CPU_ISA=AVX2`` (a Haswell..Zen 3 class CPU);
- ``default``: ``ATEN_CPU_CAPABILITY=default`` and ``ONEDNN_MAX_CPU_ISA=SSE41`` (no AVX at all).

``ATEN_CPU_CAPABILITY`` picks which of torch's compiled vectorized kernel variants ATen dispatches to
(torch.backends.cpu.get_cpu_capability() reports it); ``ONEDNN_MAX_CPU_ISA`` caps the ISA oneDNN's JIT may
use. Neither hides real instructions from MKL's own dispatch (sgemm), so fp32 GEMM-bound kernels are emulated
only partly; the table says which.

Timing: one thread (``torch.set_num_threads(1)``), median of ``--reps`` calls after warm-up, kernels
interleaved per repetition. Times in µs. The machine was shared with other jobs: ratios within one config
are more trustworthy than absolute times.

Usage: ``python benchmarks/bench_cpu_isa.py [--reps 7] [--configs native,avx2,...] [--out
benchmarks/results/cpu_isa.md]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

CONFIGS: dict[str, dict[str, str]] = {
    "native": {},
    "avx512_nobf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}
# (name, B, Hq, Hkv, Sq, Sk, D, causal)
ATTN_SHAPES = [
    ("prefill", 1, 8, 8, 512, 512, 64, True),
    ("prefill_gqa", 1, 8, 2, 256, 256, 128, True),
    ("decode", 4, 8, 8, 1, 1024, 128, False),
]
NORM_SHAPE = (512, 4096)  # tokens x hidden


def _time(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median µs per call of each callable; callables interleaved per repetition after one warm-up call."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter_ns()
            fn()
            samples[name].append((time.perf_counter_ns() - t0) / 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def _norms(reg, dtype, g, reps: int) -> dict[str, dict[str, float]]:
    """rms_norm / layer_norm kernels (and a float32-upcast F.rms_norm for half dtypes) at NORM_SHAPE."""
    import torch
    import torch.nn.functional as F

    dn = str(dtype).removeprefix("torch.")
    x = torch.randn(*NORM_SHAPE, generator=g).to(dtype)
    w = torch.randn(NORM_SHAPE[1], generator=g).to(dtype)
    bias = torch.randn(NORM_SHAPE[1], generator=g).to(dtype)
    rn, rr = reg.kernel("torch_native.rms_norm").fn, reg.kernel("reference.rms_norm").fn
    ln, lr = reg.kernel("torch_native.layer_norm").fn, reg.kernel("reference.layer_norm").fn
    rms = {
        "torch_native.rms_norm": lambda: rn(x, w, 1e-6, None),
        "reference.rms_norm": lambda: rr(x, w, 1e-6, None),
    }
    if dtype != torch.float32:
        rms["fp32_upcast F.rms_norm"] = lambda: F.rms_norm(x.float(), (x.shape[-1],), w.float(), 1e-6).to(
            dtype
        )
    lnf = {
        "torch_native.layer_norm": lambda: ln(x, w, bias, 1e-5),
        "reference.layer_norm": lambda: lr(x, w, bias, 1e-5),
    }
    return {f"rms_norm {dn}": _time(rms, reps * 3), f"layer_norm {dn}": _time(lnf, reps * 3)}


def child(reps: int) -> dict:
    """Measure in this process (its environment sets the emulated CPU); returns JSON-ready results."""
    import torch

    import layerzero as lz
    from layerzero.core.runtime import RUNTIME

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lz.which("rms_norm", torch.ones(1, 8), torch.ones(8))  # load the registry
    reg = RUNTIME.registry
    flash = reg.kernel("torch_sdpa.flash").fn
    math_ = reg.kernel("torch_sdpa.math").fn
    ref = reg.kernel("reference.attention").fn

    def upcast(q, k, v, mask, causal, scale, p):
        return flash(q.float(), k.float(), v.float(), mask, causal, scale, p).to(q.dtype)

    def math_no_onednn(q, k, v, mask, causal, scale, p):
        with torch.backends.mkldnn.flags(enabled=False):
            return math_(q, k, v, mask, causal, scale, p)

    out: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "attention": {}, "norms": {}}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        dn = str(dtype).removeprefix("torch.")
        for name, b, hq, hkv, sq, sk, d, causal in ATTN_SHAPES:
            q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
            k = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
            v = torch.randn(b, hkv, sk, d, generator=g).to(dtype)
            args = (q, k, v, None, causal, None, 0.0)
            fns = {
                "torch_sdpa.flash": lambda a=args: flash(*a),
                "torch_sdpa.math": lambda a=args: math_(*a),
                "reference.attention": lambda a=args: ref(*a),
            }
            if dtype != torch.float32:
                fns["fp32_upcast+flash"] = lambda a=args: upcast(*a)
                fns["math, oneDNN off"] = lambda a=args: math_no_onednn(*a)
            out["attention"][f"{name} {dn}"] = _time(fns, reps)
        out["norms"].update(_norms(reg, dtype, g, reps))
    return out


def _table(results: dict[str, dict], section: str) -> list[str]:
    configs = list(results)
    rows = sorted({r for c in configs for r in results[c][section]}, key=lambda r: (r.split()[-1], r))
    lines = []
    for row in rows:
        kernels = list(next(results[c][section][row] for c in configs if row in results[c][section]))
        lines += [
            f"\n**{row}** (µs; ratio = time / fastest in that column)\n",
            "| kernel | " + " | ".join(configs) + " |",
            "| --- |" + " ---: |" * len(configs),
        ]
        best = {c: min(results[c][section][row].values()) for c in configs}
        for kname in kernels:
            cells = []
            for c in configs:
                t = results[c][section][row][kname]
                cells.append(f"{t:,.0f} ({t / best[c]:.2f})")
            lines.append(f"| {kname} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Spawn one subprocess per emulated CPU, gather the results, print (and write) the markdown table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        print(json.dumps(child(ns.reps)))
        return 0
    import torch

    results: dict[str, dict] = {}
    started = time.time()
    for name in ns.configs.split(","):
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
        env.update(CONFIGS[name])
        proc = subprocess.run(
            [sys.executable, __file__, "--child", "--reps", str(ns.reps)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: done ({results[name]['capability']})", file=sys.stderr)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    lines = [
        "# CPU ISA routing measurements",
        "",
        f"- date: {datetime.date.today().isoformat()}; wall time of the run {time.time() - started:.0f} s",
        f"- machine: {cpu}, {os.cpu_count()} cores (shared with other jobs during the run), "
        f"{platform.system()} {platform.machine()}; 1 thread",
        f"- versions: Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()} native)",
        "- configs: "
        + "; ".join(
            f"`{c}` = {CONFIGS[c] or 'no override'} (torch capability {results[c]['capability']})"
            for c in results
        ),
        f"- median of {ns.reps} interleaved calls (norms: {ns.reps * 3}); generated by "
        "benchmarks/bench_cpu_isa.py",
        "",
        "## Attention",
        *_table(results, "attention"),
        "",
        "## Norms",
        *_table(results, "norms"),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
