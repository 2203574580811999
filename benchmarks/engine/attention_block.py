"""The attention block of a batch-1 Qwen3 decode step, kernel by kernel and fused, the way a decode graph runs
it: a CUDA graph of 28 layers (each layer its own KV pool and output projection, so nothing stays in L2 that
would not in a model), PDL-launched where our kernels allow it (SM 9.0+, captured), µs per layer (best of 7
replays).

Chains: each kernel alone repeated 28 times (its dependent-launch cost), then the whole block per variant:
``unfused`` = ``lz.qk_norm_rope`` -> ``lz.reshape_and_cache`` -> ``lz.paged_attention`` -> o projection (the
engine's path), ``cache-fused`` = ``lz.qk_norm_rope_cache`` (Triton kernel preferred) ->
``lz.paged_attention`` -> o projection, ``fused`` = ``lz.rope_paged_attention`` with
``triton.rope_paged_decode`` preferred (one split kernel + merge, when that op exists here);
``rope_paged_attention (default)`` = that op as selected by default. Every variant's output is compared with
the unfused path's before timing.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/engine/attention_block.py [--contexts 384,1024] [--out
FILE]`` (CUDA; Qwen3-0.6B's attention: 16 query / 8 KV heads of 128, hidden 1024, page 16, block table 2080
tokens wide).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from gemv_prefetch import LAYERS, chain_us, run_info, save_report

import layerzero as lz

HQ, HKV, D, HIDDEN, PAGE, WIDTH = 16, 8, 128, 1024, 16, 2080


class Layers:
    """28 layers' inputs for one decode token at KV length ``ctx`` (the new token's K/V go to slot
    ``ctx - 1``)."""

    def __init__(self, ctx: int, dtype: torch.dtype = torch.bfloat16) -> None:
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(0)
        nblk = (ctx + PAGE - 1) // PAGE
        self.qkv = [
            torch.randn(1, (HQ + 2 * HKV) * D, device=dev, dtype=dtype, generator=g) for _ in range(LAYERS)
        ]
        self.caches = [lz.allocate_kv_cache(nblk + 1, PAGE, HKV, D, dtype, device=dev) for _ in range(LAYERS)]
        for c in self.caches:
            c.normal_(generator=g)
        self.o_w = [
            torch.randn(HIDDEN, HQ * D, device=dev, dtype=dtype, generator=g) / 45 for _ in range(LAYERS)
        ]
        self.qw = torch.rand(D, device=dev, dtype=dtype, generator=g) + 0.5
        self.kw = torch.rand(D, device=dev, dtype=dtype, generator=g) + 0.5
        t = torch.arange(4096, device=dev).float()
        freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
        emb = torch.cat([torch.outer(t, freq)] * 2, -1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.pos = torch.tensor([ctx - 1], device=dev)
        self.slots = torch.tensor([ctx - 1], device=dev)
        bt = torch.zeros(1, WIDTH // PAGE, dtype=torch.int32, device=dev)
        bt[0, :nblk] = torch.arange(nblk, dtype=torch.int32, device=dev)
        self.bt = bt
        self.lens = torch.tensor([ctx], dtype=torch.int32, device=dev)

    def qkv_views(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv[i].split([HQ * D, HKV * D, HKV * D], -1)
        return q.view(1, HQ, D), k.view(1, HKV, D), v.view(1, HKV, D)

    def qk_norm_rope(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self.qkv_views(i)
        qr, kr = lz.qk_norm_rope(
            q[None],
            k[None],
            self.qw,
            self.kw,
            self.cos,
            self.sin,
            eps=1e-6,
            position_ids=self.pos.view(1, 1),
            layout="BSHD",
        )
        return qr[0], kr[0]

    def cache(self, i: int, k: torch.Tensor | None = None) -> None:
        _, k0, v = self.qkv_views(i)
        lz.reshape_and_cache(k0 if k is None else k, v, self.caches[i], self.slots)

    def qk_norm_rope_cache(self, i: int) -> torch.Tensor:
        q, k, v = self.qkv_views(i)
        qr, _ = lz.qk_norm_rope_cache(
            q,
            k,
            v,
            self.qw,
            self.kw,
            self.cos,
            self.sin,
            self.caches[i],
            self.slots,
            position_ids=self.pos,
            eps=1e-6,
        )
        return qr

    def paged(self, i: int, q: torch.Tensor | None = None) -> torch.Tensor:
        q = self.qkv_views(i)[0] if q is None else q
        return lz.paged_attention(q, self.caches[i], self.bt, self.lens, scale=D**-0.5)

    def o_proj(self, i: int, o: torch.Tensor) -> torch.Tensor:
        return lz.linear(o.reshape(1, HQ * D), self.o_w[i])

    def unfused(self, i: int) -> torch.Tensor:
        q, k = self.qk_norm_rope(i)
        self.cache(i, k)
        return self.paged(i, q)

    def cache_fused(self, i: int) -> torch.Tensor:
        return self.paged(i, self.qk_norm_rope_cache(i))

    def fused(self, i: int) -> torch.Tensor:
        q, k, v = self.qkv_views(i)
        return lz.rope_paged_attention(
            q,
            k,
            v,
            self.cos,
            self.sin,
            self.caches[i],
            self.slots,
            self.bt,
            self.lens,
            position_ids=self.pos,
            q_weight=self.qw,
            k_weight=self.kw,
            eps=1e-6,
            scale=D**-0.5,
        )


def run(ctx: int) -> list[str]:
    """Table rows of one KV length."""
    ly = Layers(ctx)
    rows = []
    singles: dict[str, Callable[[int], object]] = {
        "qk_norm_rope": ly.qk_norm_rope,
        "reshape_and_cache": ly.cache,
        "paged_attention": ly.paged,
        "o_proj (lz.linear)": lambda i: ly.o_proj(i, ly.qkv[i][:, : HQ * D]),
    }
    with lz.prefer("triton.qk_norm_rope_cache"):
        singles["qk_norm_rope_cache (triton)"] = ly.qk_norm_rope_cache
    blocks: dict[str, Callable[[int], torch.Tensor]] = {"unfused": ly.unfused}
    blocks["cache-fused"] = ly.cache_fused
    if hasattr(lz, "rope_paged_attention"):
        blocks["fused"] = ly.fused
        singles["rope_paged_attention (default)"] = ly.fused
    ref = [ly.unfused(i).float() for i in range(3)]

    def prefer(name: str):
        return (
            lz.prefer("triton.rope_paged_decode")
            if name == "fused"
            else lz.prefer("triton.qk_norm_rope_cache")
        )

    for name, fn in list(blocks.items()):
        with prefer(name):
            got = [fn(i).float() for i in range(3)]
        err = max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))
        rows.append(f"| {ctx} | check {name} vs unfused | max abs diff {err:.3g} | |")
    for name, fn in singles.items():
        with lz.prefer("triton.qk_norm_rope_cache"):
            us = chain_us(fn)
        rows.append(f"| {ctx} | {name} alone | {us:.2f} | |")
    for name, fn in blocks.items():
        with prefer(name):
            us = chain_us(fn)
            us_o = chain_us(lambda i, fn=fn: ly.o_proj(i, fn(i)))
        rows.append(f"| {ctx} | block {name} | {us:.2f} | {us_o:.2f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="384,1024")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = [
        f"# Batch-1 attention block, 28-layer graphs ({run_info()})",
        "",
        "| KV len | chain | µs per layer | with o projection |",
        "| ---: | --- | ---: | ---: |",
    ]
    for ctx in (int(c) for c in a.contexts.split(",")):
        lines += run(ctx)
        print("\n".join(lines), flush=True)
    save_report(lines, a.out)


if __name__ == "__main__":
    main()
