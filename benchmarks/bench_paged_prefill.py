"""Paged prefill kernels side by side: one ``lz.paged_attention`` call at a mixed step's shape (Qwen3-0.6B
heads: 16 q / 8 kv, D 128, pages of 16; 8 prompts of ~1000 tokens, 2 chunks appended to ~1500 cached tokens,
64 decode rows), each prefill-capable kernel locked in turn, on a bf16 cache and on fp8 / int8 caches. CUDA
events around each call, median of ``--iters`` after warm-up; every kernel's output is compared with the first
one's.

Usage: ``PYTHONPATH=src python benchmarks/bench_paged_prefill.py --out FILE.md`` (CUDA)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import layerzero as lz

KERNELS = ("triton.paged_prefill", "flashinfer.paged_attention", "torch_sdpa.paged_attention")


def mixed_step(kv_dtype: torch.dtype, seed: int = 0):
    """(q, cache, block_tables, seq_lens, cu_seqlens_q, scales) of one mixed step on CUDA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    page, hkv, hq, d = 16, 8, 16, 128
    q_lens = [1000, 997, 1003, 990, 1010, 1001, 999, 1000, 300, 250] + [1] * 64
    kv_lens = (
        q_lens[:8]
        + [1800, 1750]
        + [int(x) for x in torch.randint(200, 2000, (64,), generator=g, device="cuda").tolist()]
    )
    width = max(-(-n // page) for n in kv_lens)
    blocks = len(q_lens) * width
    cache = torch.randn(blocks, 2, page, hkv, d, device="cuda", generator=g)
    scales = {}
    if kv_dtype in (torch.float8_e4m3fn, torch.int8):
        s = 0.02 if kv_dtype == torch.int8 else 0.25
        scales = {"k_scale": s, "v_scale": s}
        cache = (cache / s).clamp(-127, 127)
        cache = cache.round().to(kv_dtype) if kv_dtype == torch.int8 else cache.to(kv_dtype)
    else:
        cache = cache.to(kv_dtype)
    tables = torch.randperm(blocks, device="cuda", generator=g).view(len(q_lens), width).to(torch.int32)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, cache, tables, lens, cu, scales


def time_kernel(kernel: str, args, scales, iters: int):
    """(median µs, output) of ``kernel`` locked, or (None, reason) when it cannot run this call."""
    q, cache, tables, lens, cu = args
    try:
        lz.lock("paged_attention", kernel)
    except lz.LayerZeroError as exc:
        return None, str(exc).splitlines()[0][:120]
    try:
        out = lz.paged_attention(q, cache, tables, lens, cu_seqlens_q=cu, **scales)
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            lz.paged_attention(q, cache, tables, lens, cu_seqlens_q=cu, **scales)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times), out
    except lz.LayerZeroError as exc:
        return None, str(exc).splitlines()[0][:120]
    finally:
        lz.unlock("paged_attention")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    lines = [
        f"# Paged prefill kernels at a mixed step ({torch.cuda.get_device_name()}, torch "
        f"{torch.__version__})",
        "",
        "8 prompts of ~1000 tokens, 2 chunks of 300 / 250 tokens appended to 1800 / 1750 cached, 64 decode "
        f"rows (KV 200-2000); 16 q / 8 kv heads, D 128, pages of 16; q bf16. Median of {a.iters} calls (CUDA "
        "events; 2 for torch_sdpa) after one warm-up.",
        "",
        "| cache | kernel | µs | max abs diff vs first |",
        "| --- | --- | ---: | ---: |",
    ]
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.int8):
        q, cache, tables, lens, cu, scales = mixed_step(kv_dtype)
        first = None
        for kernel in KERNELS:
            iters = 2 if kernel.startswith("torch_sdpa") else a.iters  # seconds a call there (2026-11-28e)
            us, out = time_kernel(kernel, (q, cache, tables, lens, cu), scales, iters)
            name = str(kv_dtype).removeprefix("torch.")
            if us is None:
                lines.append(f"| {name} | {kernel} | n/a: {out} | |")
                continue
            diff = "" if first is None else f"{float((out.float() - first.float()).abs().max()):.2e}"
            first = out if first is None else first
            lines.append(f"| {name} | {kernel} | {us:.0f} | {diff} |")
            print(lines[-1], flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
