"""In-graph cost of LayerZero's kernels on decode-sized inputs: each kernel (``lz.lock``) timed inside a CUDA graph
of 50 back-to-back calls, best of 5 replays, so launch overhead on the host does not count (what a decode step
captured in a CUDA graph pays). Shapes: a Qwen3-0.6B layer (hidden 1024, 16 query / 8 KV heads of 128, MLP 3072,
vocabulary 151,936), bf16, rows M = decode batch size.

Ops: ``linear`` (every projection and the LM head: ``torch_native.linear`` = cuBLAS vs ``triton.gemv``; GB/s of
weight traffic), ``rms_norm`` (plain, with fused residual, and the per-head q/k norms), ``swiglu``.

Usage: ``PYTHONPATH=src python benchmarks/bench_in_graph.py --out benchmarks/results/in_graph_h200.md`` (CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import platform
from collections.abc import Callable
from typing import Any

import torch

import layerzero as lz

LINEAR = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}


def graph_us(fn: Callable[[], Any], reps: int = 50) -> float:
    """µs per call of ``fn`` inside a CUDA graph of ``reps`` calls (best of 5 replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return best


def locked_us(op: str, kernel_id: str, fn: Callable[[], Any]) -> float | None:
    """:func:`graph_us` of ``fn`` with ``op`` locked to ``kernel_id``; None when that kernel cannot run here."""
    lz.lock(op, kernel_id)
    try:
        fn()
        return graph_us(fn)
    except lz.LayerZeroError as exc:
        print(f"{op} {kernel_id}: {str(exc).splitlines()[0][:120]}")
        return None
    finally:
        lz.unlock(op)


def _fmt(t: float | None) -> str:
    return "-" if t is None else f"{t:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,2,4,8,16")
    a = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows = [int(r) for r in a.rows.split(",")]
    lines = [f"# In-graph µs per call on {torch.cuda.get_device_name()} (bf16, Qwen3-0.6B layer shapes)", "",
             f"- date {datetime.date.today()}, torch {torch.__version__}, host {platform.processor() or platform.machine()}; "
             "`benchmarks/bench_in_graph.py`: 50 calls in one CUDA graph, best of 5 replays", "",
             "## linear (y = x @ W.T; GB/s = weight bytes / time)", "",
             "| proj (N x K) | M | cuBLAS µs | GB/s | triton.gemv µs | GB/s | gemv / cuBLAS | default |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, (n, k) in LINEAR.items():
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.05
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            cub = locked_us("linear", "torch_native.linear", lambda x=x, w=w: lz.linear(x, w))
            tri = locked_us("linear", "triton.gemv", lambda x=x, w=w: lz.linear(x, w))
            gb = n * k * 2 / 1e3
            ratio = "-" if cub is None or tri is None else f"{tri / cub:.2f}"
            lines.append(f"| {name} ({n} x {k}) | {m} | {_fmt(cub)} | {gb / cub:.0f} | {_fmt(tri)} | "
                         f"{'-' if tri is None else f'{gb / tri:.0f}'} | {ratio} | {lz.which('linear', x, w)} |")
            print(lines[-1], flush=True)
    lines += ["", "## norms and activation", "", "| op | input | M | torch_native µs | triton µs | triton / torch |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for m in rows:
        h = torch.randn(m, 1024, device=dev, dtype=dt)
        r = torch.randn(m, 1024, device=dev, dtype=dt)
        wn = torch.rand(1024, device=dev, dtype=dt) + 0.5
        q = torch.randn(m, 16, 128, device=dev, dtype=dt)
        wq = torch.rand(128, device=dev, dtype=dt) + 0.5
        gu = torch.randn(m, 6144, device=dev, dtype=dt)
        gate, up = gu.chunk(2, dim=-1)
        cases = [("rms_norm", "x [M, 1024]", lambda h=h, wn=wn: lz.rms_norm(h, wn, 1e-6)),
                 ("rms_norm", "x + residual [M, 1024]", lambda h=h, r=r, wn=wn: lz.rms_norm(h, wn, 1e-6, residual=r)),
                 ("rms_norm", "q heads [M, 16, 128]", lambda q=q, wq=wq: lz.rms_norm(q, wq, 1e-6)),
                 ("swiglu", "gate/up halves [M, 3072]", lambda gate=gate, up=up: lz.swiglu(gate, up))]
        for op, what, fn in cases:
            t0 = locked_us(op, f"torch_native.{op}", fn)
            t1 = locked_us(op, f"triton.{op}", fn)
            ratio = "-" if t0 is None or t1 is None else f"{t1 / t0:.2f}"
            lines.append(f"| {op} | {what} | {m} | {_fmt(t0)} | {_fmt(t1)} | {ratio} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
