"""``triton.paged_decode``'s launch config at batch 1, timed the way a decode graph runs it: 28-layer CUDA
graphs of ``paged_decode`` alone (each layer its own KV pool; PDL-launched on SM 9.0+), µs per layer (best of
7 replays) for every (KV splits, tile positions ``block_n``, warps) at Qwen3-0.6B's attention shape (16 query
/ 8 KV heads of 128, bf16, page 16, a block table 2080 tokens wide, as the engine's decode graphs pass it).
Each config's output is checked against the default config's before it is timed. ``tune_paged_decode.py``
searched the sweep's larger shapes; this is the latency-bound corner a batch-1 decode step lives in.

Usage: ``PYTHONPATH=src:benchmarks:benchmarks/engine python benchmarks/engine/paged_b1_search.py [--contexts
256,384,512,1024] [--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse
import itertools

import torch
from attention_block import D, Layers
from gemv_prefetch import chain_us, run_info, save_report

from layerzero.backends.triton import paged as tp
from layerzero.backends.triton import rope as tr
from layerzero.core.knobs import knobs

SPLITS = (1, 2, 4, 8, 16, 32)
BLOCK_N = (16, 32, 64, 128)
WARPS = (2, 4, 8)


def search(ctx: int, top: int) -> list[str]:
    """Table rows for one KV length: the default config, then the ``top`` fastest."""
    ly = Layers(ctx)
    q = [ly.qkv_views(i)[0].contiguous() for i in range(len(ly.caches))]

    def run(i: int, **kw: int) -> torch.Tensor:
        return tp.paged_decode(q[i], ly.caches[i], ly.bt, ly.lens, D**-0.5, "NHD", **kw)

    want = run(0)
    default = chain_us(run)
    rows = []
    for splits, bn, warps in itertools.product(SPLITS, BLOCK_N, WARPS):
        kw = dict(num_splits=splits, block_n=bn, num_warps=warps)
        got = run(0, **kw)
        if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
            rows.append((float("inf"), f"| {ctx} | splits {splits}, block_n {bn}, warps {warps} | WRONG |"))
            continue
        us = chain_us(lambda i, kw=kw: run(i, **kw))
        rows.append((us, f"| {ctx} | splits {splits}, block_n {bn}, warps {warps} | {us:.2f} |"))
    rows.sort(key=lambda r: r[0])
    for bh in (16, 8, 4, 2, 1):
        with knobs(tr.KNOBS, block_h_max=bh):
            us = chain_us(ly.qk_norm_rope_cache)
        rows.append((-1.0, f"| {ctx} | lz.qk_norm_rope_cache, at most {bh} heads a program | {us:.2f} |"))
    plan = tp._plan(
        tp._KERNELS.get(), q[0], ly.caches[0], ly.bt, ly.lens, "NHD", False, None, None, None, None
    )
    return (
        [
            f"| {ctx} | default ({plan.splits} splits, block_n {plan.split_kw['BLOCK_N']}, warps "
            f"{plan.split_kw['num_warps']}) | {default:.2f} |"
        ]
        + [r[1] for r in rows if r[0] >= 0][:top]
        + [r[1] for r in rows if r[0] < 0]
    )


GRID = (
    (16, 32, 8),
    (32, 32, 8),
    (32, 32, 4),
    (16, 64, 8),
    (32, 64, 8),
    (32, 64, 4),
    (16, 128, 4),
    (32, 128, 4),
)
"""(splits, block_n, warps) timed at every length of ``--grid`` (the fastest configs of the search)."""


def grid(contexts: list[int]) -> list[str]:
    """One row per KV length: the default config, then each of :data:`GRID`, µs per layer."""
    lines = [
        "| KV len | default | " + " | ".join(f"{s}/{b}/{w}" for s, b, w in GRID) + " |",
        "| ---: | ---: | " + " | ".join("---:" for _ in GRID) + " |",
    ]
    for ctx in contexts:
        ly = Layers(ctx)
        q = [ly.qkv_views(i)[0].contiguous() for i in range(len(ly.caches))]

        def run(i: int, q: list[torch.Tensor] = q, ly: Layers = ly, **kw: int) -> torch.Tensor:
            return tp.paged_decode(q[i], ly.caches[i], ly.bt, ly.lens, D**-0.5, "NHD", **kw)

        want = run(0)
        cells = [f"{chain_us(run):.2f}"]
        for splits, bn, warps in GRID:
            kw = dict(num_splits=splits, block_n=bn, num_warps=warps)
            ok = torch.allclose(run(0, **kw).float(), want.float(), rtol=2e-2, atol=2e-2)
            cells.append(f"{chain_us(lambda i, kw=kw: run(i, **kw)):.2f}" if ok else "WRONG")
        lines.append(f"| {ctx} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="256,384,512,1024")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--grid", default=None, help="KV lengths for the grid of GRID's configs (instead of the search)"
    )
    a = ap.parse_args()
    head = f"({run_info()})"
    if a.grid:
        lines = [
            "# triton.paged_decode at batch 1: (splits / block_n / warps) by KV length, 28-layer graphs, µs "
            f"per layer {head}",
            "",
            *grid([int(c) for c in a.grid.split(",")]),
        ]
    else:
        lines = [
            f"# triton.paged_decode at batch 1, 28-layer graphs {head}",
            "",
            "| KV len | config | µs per layer |",
            "| ---: | --- | ---: |",
        ]
        for ctx in (int(c) for c in a.contexts.split(",")):
            lines += search(ctx, a.top)
            print("\n".join(lines), flush=True)
    save_report(lines, a.out)


if __name__ == "__main__":
    main()
