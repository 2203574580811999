"""ALiBi attention on CPU: ``torch_sdpa.flash`` (the CPU flash kernel with the explicit float32 bias; the
default for ``lz.attention(alibi_slopes=...)`` on CPU since 2026-11-27) against ``torch_sdpa.math`` (the bias
the same way; the default before) and the reference kernel, each locked, side by side in one process, best of
``--reps`` calls.

Usage: ``PYTHONPATH=src python benchmarks/bench_alibi_cpu.py [--out FILE]``. Records the CPU, its flags,
torch's CPU capability and threads.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date

import torch

import layerzero as lz

SHAPES = [(1, 8, 512, 64), (2, 16, 1024, 64), (1, 32, 2048, 128)]
KERNELS = ("torch_sdpa.flash", "torch_sdpa.math", "reference.attention")


def _cpu() -> tuple[str, str]:
    name, flags = platform.processor() or "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, " ".join(
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile") if f in flags
    )


def best_ms(kernel: str, q, k, v, slopes, reps: int) -> float:
    lz.lock("attention", kernel)
    try:
        lz.attention(q, k, v, is_causal=True, alibi_slopes=slopes)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            lz.attention(q, k, v, is_causal=True, alibi_slopes=slopes)
            best = min(best, time.perf_counter() - t)
        return best * 1e3
    finally:
        lz.unlock("attention")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    name, flags = _cpu()
    lines = [
        f"# ALiBi attention on CPU ({date.today()})",
        "",
        f"{name}; flags {flags}; torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads. float32, causal, "
        "Press et al. slopes; ms per call (best of the reps), each kernel locked.",
        "",
        "| B, H, S, D | " + " | ".join(KERNELS) + " | math / flash |",
        "| --- |" + " ---: |" * (len(KERNELS) + 1),
    ]
    for b, h, s, d in SHAPES:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
        ms = [best_ms(kid, q, k, v, slopes, a.reps if kid != "reference.attention" else 1) for kid in KERNELS]
        lines.append(
            f"| {b}, {h}, {s}, {d} | " + " | ".join(f"{t:.1f}" for t in ms) + f" | {ms[1] / ms[0]:.2f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
