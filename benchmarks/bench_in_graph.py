"""In-graph cost of LayerZero's kernels on decode-sized inputs: each kernel (``lz.lock``) timed inside a CUDA
graph of 50 back-to-back calls, best of 5 replays, so launch overhead on the host does not count (what a
decode step captured in a CUDA graph pays). Shapes: a Qwen3-0.6B layer (hidden 1024, 16 query / 8 KV heads of
128, MLP 3072, vocabulary 151,936), bf16, rows M = decode batch size.

Sections (``--sections``, default all): ``linear`` (every projection and the LM head: ``torch_native.linear``
= cuBLAS vs ``triton.gemv``; GB/s of weight traffic), ``norms`` (``rms_norm`` plain, with fused residual, and
the per-head q/k norms; ``swiglu``), ``qk`` (Qwen3's q/k norm + RoPE on views of the QKV projection: two
``lz.rms_norm`` and one ``lz.rope`` vs one ``lz.qk_norm_rope``, default kernels), ``paged``
(``triton.paged_decode`` at B = 1-8 sequences of 256-2048 tokens in a block table 2080 tokens wide, as the
engine's decode graphs pass it: the default split count vs forced ones; 1 = no merge launch).

Usage: ``PYTHONPATH=src python benchmarks/bench_in_graph.py --out benchmarks/results/in_graph_h200.md``
(CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import platform
from collections.abc import Callable
from typing import Any

import torch

import layerzero as lz

LINEAR = {
    "qkv": (4096, 1024),
    "o": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
    "lm_head": (151936, 1024),
}


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
    """:func:`graph_us` of ``fn`` with ``op`` locked to ``kernel_id``; None when that kernel cannot run
    here."""
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
    ap.add_argument("--sections", default="linear,norms,qk,paged")
    a = ap.parse_args(argv)
    sections = set(a.sections.split(","))
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    rows = [int(r) for r in a.rows.split(",")]
    lines = [
        f"# In-graph µs per call on {torch.cuda.get_device_name()} (bf16, Qwen3-0.6B layer shapes)",
        "",
        f"- date {datetime.date.today()}, torch {torch.__version__}, host "
        f"{platform.processor() or platform.machine()}; `benchmarks/bench_in_graph.py`: 50 calls in one CUDA "
        "graph, best of 5 replays",
        "",
    ]
    if "linear" in sections:
        lines += _linear(rows, dev, dt)
    if "norms" in sections:
        lines += _norms(rows, dev, dt)
    if "qk" in sections:
        lines += _qk(rows, dev, dt)
    if "paged" in sections:
        lines += _paged(dev, dt)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


def _linear(rows: list[int], dev: str, dt: torch.dtype) -> list[str]:
    lines = [
        "## linear (y = x @ W.T; GB/s = weight bytes / time)",
        "",
        "| proj (N x K) | M | cuBLAS µs | GB/s | triton.gemv µs | GB/s | gemv / cuBLAS | default |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, (n, k) in LINEAR.items():
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.05
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            cub = locked_us("linear", "torch_native.linear", lambda x=x, w=w: lz.linear(x, w))
            tri = locked_us("linear", "triton.gemv", lambda x=x, w=w: lz.linear(x, w))
            gb = n * k * 2 / 1e3
            ratio = "-" if cub is None or tri is None else f"{tri / cub:.2f}"
            lines.append(
                f"| {name} ({n} x {k}) | {m} | {_fmt(cub)} | {gb / cub:.0f} | {_fmt(tri)} | "
                f"{'-' if tri is None else f'{gb / tri:.0f}'} | {ratio} | {lz.which('linear', x, w)} |"
            )
            print(lines[-1], flush=True)
    return lines


def _norms(rows: list[int], dev: str, dt: torch.dtype) -> list[str]:
    lines = [
        "",
        "## norms and activation",
        "",
        "| op | input | M | torch_native µs | triton µs | triton / torch |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for m in rows:
        h = torch.randn(m, 1024, device=dev, dtype=dt)
        r = torch.randn(m, 1024, device=dev, dtype=dt)
        wn = torch.rand(1024, device=dev, dtype=dt) + 0.5
        q = torch.randn(m, 16, 128, device=dev, dtype=dt)
        wq = torch.rand(128, device=dev, dtype=dt) + 0.5
        gu = torch.randn(m, 6144, device=dev, dtype=dt)
        gate, up = gu.chunk(2, dim=-1)
        cases = [
            ("rms_norm", "x [M, 1024]", lambda h=h, wn=wn: lz.rms_norm(h, wn, 1e-6)),
            (
                "rms_norm",
                "x + residual [M, 1024]",
                lambda h=h, r=r, wn=wn: lz.rms_norm(h, wn, 1e-6, residual=r),
            ),
            ("rms_norm", "q heads [M, 16, 128]", lambda q=q, wq=wq: lz.rms_norm(q, wq, 1e-6)),
            ("swiglu", "gate/up halves [M, 3072]", lambda gate=gate, up=up: lz.swiglu(gate, up)),
        ]
        for op, what, fn in cases:
            t0 = locked_us(op, f"torch_native.{op}", fn)
            t1 = locked_us(op, f"triton.{op}", fn)
            ratio = "-" if t0 is None or t1 is None else f"{t1 / t0:.2f}"
            lines.append(f"| {op} | {what} | {m} | {_fmt(t0)} | {_fmt(t1)} | {ratio} |")
            print(lines[-1], flush=True)
    return lines


def _qk(rows: list[int], dev: str, dt: torch.dtype) -> list[str]:
    """Qwen3's per-head q/k RMSNorm + RoPE on BSHD views of the QKV projection ``[M, 4096]``, default
    kernels."""
    lines = [
        "",
        "## q/k norm + RoPE (views of the QKV projection, positions from a 4096-row table)",
        "",
        "| M | 2 x lz.rms_norm + lz.rope µs | lz.qk_norm_rope µs | fused / unfused | kernels |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    ang = torch.arange(4096, device=dev)[:, None] * torch.rand(64, device=dev)[None]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dt), torch.cat((ang.sin(), ang.sin()), -1).to(dt)
    wq, wk = (torch.rand(128, device=dev, dtype=dt) + 0.5 for _ in range(2))
    for m in rows:
        qkv = torch.randn(1, m, 32, 128, device=dev, dtype=dt)
        q, k = qkv[:, :, :16], qkv[:, :, 16:24]
        pos = torch.randint(0, 4096, (1, m), device=dev)

        def unfused(q=q, k=k, pos=pos):
            return lz.rope(
                lz.rms_norm(q, wq, 1e-6), lz.rms_norm(k, wk, 1e-6), cos, sin, position_ids=pos, layout="BSHD"
            )

        def fused(q=q, k=k, pos=pos):
            return lz.qk_norm_rope(q, k, wq, wk, cos, sin, eps=1e-6, position_ids=pos, layout="BSHD")

        t0, t1 = graph_us(unfused), graph_us(fused)
        with lz.capture_selection(), lz.trace() as t:
            unfused()
            fused()
        lines.append(
            f"| {m} | {t0:.2f} | {t1:.2f} | {t1 / t0:.2f} | {', '.join(sorted({k for _, k in t.counts}))} |"
        )
        print(lines[-1], flush=True)
    return lines


def engine_decode_cases(dev: str, dt: torch.dtype):
    """Decode inputs as the engine's decode graphs pass them (Qwen3-0.6B heads: 16 query / 8 KV of 128, pages
    of 16, a block table 130 blocks = 2080 tokens wide): yields ``(B, tokens, q, cache, block_tables,
    seq_lens, splits)`` for B = 1, 2, 4, 8 and 256 / 768 / 2048 tokens per sequence, ``splits`` the default
    split count (it follows the table's width, not the lengths: graphs are shape-static)."""
    from layerzero.backends.triton import paged

    width, page = 130, 16
    cache = lz.allocate_kv_cache(8 * width + 1, page, 8, 128, dtype=dt, device=dev)
    cache.normal_()
    for b in (1, 2, 4, 8):
        tables = torch.randperm(8 * width, device=dev)[: b * width].view(b, width).int()
        for tokens in (256, 768, 2048):
            lens = torch.full((b,), tokens, dtype=torch.int32, device=dev)
            q = torch.randn(b, 16, 128, device=dev, dtype=dt)
            splits = paged.choose_split_len(
                b, 8, width * page, paged.sm_count(q.device), paged.block_n_for(128, 2)
            )[1]
            yield b, tokens, q, cache, tables, lens, splits


def _paged(dev: str, dt: torch.dtype) -> list[str]:
    """``triton.paged_decode`` in a 2080-token-wide block table (the split count follows the width, not the
    lengths: graphs are shape-static): default splits vs forced counts."""
    from layerzero.backends.triton import paged

    lines = [
        "",
        "## paged decode (triton.paged_decode; 16 q / 8 KV heads of 128, pages of 16, table 130 blocks)",
        "",
        "| B | tokens | default splits | default µs | 1 split µs | 2 splits µs | 4 splits µs | best / "
        "default |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b, tokens, q, cache, tables, lens, splits in engine_decode_cases(dev, dt):
        times = [
            graph_us(lambda n=n, q=q, c=cache, t=tables, s=lens: paged.paged_decode(q, c, t, s, num_splits=n))
            for n in (None, 1, 2, 4)
        ]
        lines.append(
            f"| {b} | {tokens} | {splits} | "
            + " | ".join(f"{x:.2f}" for x in times)
            + f" | {min(times) / times[0]:.2f} |"
        )
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
