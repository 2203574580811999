"""Launch-config search for the LM head of a batch-1 decode step (Qwen3-0.6B: ``[151936, 1024]`` bf16, 311 MB,
one row): ``_gemv_dot`` (what ``triton.gemv`` runs for N > 16384) over tile sizes wider than
``gemv_configs.py`` tried (its best, BN 64, sat at the edge of its grid), and ``_gemv_prefetch`` (the whole
``[BN, K]`` slab a program), timed inside CUDA graphs (``bench_in_graph.graph_us``) next to cuBLAS; µs per
call and the read rate (weight bytes / time).

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/lm_head_configs.py [--rows 1] [--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from bench_in_graph import graph_us
from gemv_prefetch import run_info, save_report

from layerzero.backends.triton import _gemv_kernels as kern
from layerzero.backends.triton._common import cdiv, next_pow2

VOCAB, HIDDEN = 151936, 1024


def configs() -> list[tuple[str, dict]]:
    dot = [
        ("dot", {"BN": bn, "BK": bk, "num_warps": w, "num_stages": st})
        for bn, bk, w, st in itertools.product((64, 128, 256), (64, 128, 256), (4, 8), (3, 4, 5))
        if bn * bk <= 32768
    ]
    pre = [("prefetch", {"BN": bn, "num_warps": w}) for bn, w in itertools.product((4, 8, 16), (1, 2, 4, 8))]
    return dot + pre


def call(x, w, out, kind, cfg):
    m, k = x.shape
    n = w.shape[0]
    if kind == "dot":
        kern._gemv_dot[(cdiv(n, cfg["BN"]),)](
            x,
            w,
            out,
            out,
            m,
            n,
            x.stride(0),
            w.stride(0),
            out.stride(0),
            K=k,
            HAS_BIAS=False,
            BM=16,
            UPCAST=False,
            **cfg,
        )
    else:
        kern._gemv_prefetch[(cdiv(n, cfg["BN"]),)](
            x,
            w,
            out,
            out,
            m,
            n,
            x.stride(0),
            w.stride(0),
            out.stride(0),
            out,
            out,
            out,
            0,
            0,
            0.0,
            K=k,
            KP=next_pow2(k),
            HAS_BIAS=False,
            BM=next_pow2(m),
            **cfg,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) / 32
    gb = w.numel() * w.element_size() / 1e9
    lines = [
        f"# LM head configs, [{VOCAB}, {HIDDEN}] bf16 ({gb * 1e3:.0f} MB), CUDA graphs ({run_info()})",
        "",
        "| rows | kernel | config | µs | TB/s | max abs diff vs cuBLAS |",
        "| ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for m in (int(r) for r in a.rows.split(",")):
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        want = F.linear(x, w)
        us = graph_us(lambda x=x: F.linear(x, w), reps=20)
        lines.append(f"| {m} | cuBLAS | | {us:.2f} | {gb / us * 1e3:.2f} | 0 |")
        print(lines[-1], flush=True)
        results = []
        for kind, cfg in configs():
            out = torch.empty(m, VOCAB, device="cuda", dtype=torch.bfloat16)
            try:
                diff = (call(x, w, out, kind, cfg).float() - want.float()).abs().max().item()
                us = graph_us(lambda x=x, out=out, kind=kind, cfg=cfg: call(x, w, out, kind, cfg), reps=20)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                print(f"{kind} {cfg}: {type(exc).__name__}", flush=True)
                continue
            results.append((us, f"| {m} | {kind} | {cfg} | {us:.2f} | {gb / us * 1e3:.2f} | {diff:.3g} |"))
            print(results[-1][1], flush=True)
        lines += [row for _, row in sorted(results)]
    print("\n".join(lines), flush=True)
    save_report(lines, a.out)


if __name__ == "__main__":
    main()
