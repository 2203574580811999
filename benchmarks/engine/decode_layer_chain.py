"""A whole batch-1 Qwen3 decode layer the way the engine's decode graph runs it (``lz.rms_norm_linear`` QKV ->
``lz.qk_norm_rope_cache`` -> paged split + merge -> o projection -> ``lz.rms_norm_linear`` gate/up ->
``lz.swiglu_linear`` down), 28 layers in one CUDA graph (each its own weights and KV pool), PDL-launched, µs
per layer (best of 7 replays), with ``triton.paged_decode``'s launch knobs (KV positions per tile, pipeline
stages, warps, splits) varied inside that chain: at batch 1 a split walks one or two tiles, so the pipeline's
shared memory buys nothing, while it decides whether the split kernel's programs fit on an SM beside the
projection's (PDL overlaps a kernel's launch with the one before only when its programs fit). Also each
kernel's registers and shared memory as compiled.

Caution (2026-11-28, H200): this chain did not predict the engine. 64-position tiles with 2 stages and up to
32 splits ran this chain 0.3-1.6 µs a layer faster than the default at 384-2048 tokens, yet the engine's
batch-1 decode graph with them was 748 vs 725 µs (``benchmarks/engine/batch1_ab.py``): an engine A/B decides,
this chain only proposes.

Usage: ``PYTHONPATH=src:benchmarks:benchmarks/engine python benchmarks/engine/decode_layer_chain.py
[--contexts 384,1024] [--out FILE]`` (CUDA; Qwen3-0.6B: hidden 1024, 16 query / 8 KV heads of 128,
intermediate 3072, page 16, block table 2080 tokens wide).
"""

from __future__ import annotations

import argparse

import torch
from attention_block import HIDDEN, HQ, D, Layers
from gemv_prefetch import LAYERS, chain_us, run_info, save_report

import layerzero as lz
from layerzero.backends.triton import _gemv_kernels, _paged_kernels, _rope_kernels, paged
from layerzero.backends.triton import gemv as tg
from layerzero.core.knobs import knobs as set_knobs

INTER = 3072
# (block_n, num_stages, num_warps, num_splits); None = the default (128 / 3 / 4 / 6 for the 2080-token table)
KNOBS = [
    (None, None, None, None),
    (32, 2, None, None),
    (32, 2, None, 16),
    (64, 2, None, 32),
    (64, 2, None, 16),
    (64, 1, None, 32),
    (64, 2, 8, 32),
    (128, 1, None, None),
    (None, None, None, None),
]


class Model(Layers):
    """:class:`Layers` plus each layer's MLP and norm weights (random, bf16)."""

    def __init__(self, ctx: int) -> None:
        super().__init__(ctx)
        g = torch.Generator(device="cuda").manual_seed(1)
        bf = dict(device="cuda", dtype=torch.bfloat16)
        self.x = torch.randn(1, HIDDEN, **bf, generator=g)
        self.res = torch.randn(1, HIDDEN, **bf, generator=g)
        self.nw = torch.rand(HIDDEN, **bf, generator=g) + 0.5
        self.w_qkv = [
            torch.randn(self.qkv[0].shape[1], HIDDEN, **bf, generator=g) / 32 for _ in range(LAYERS)
        ]
        self.w_gu = [torch.randn(2 * INTER, HIDDEN, **bf, generator=g) / 32 for _ in range(LAYERS)]
        self.w_down = [torch.randn(HIDDEN, INTER, **bf, generator=g) / 55 for _ in range(LAYERS)]

    def layer(self, i: int, knobs: tuple) -> torch.Tensor:
        bn, stages, warps, splits = knobs
        qkv, res = lz.rms_norm_linear(self.x, self.nw, self.w_qkv[i], eps=1e-6, residual=self.res)
        q, k, v = qkv.split([HQ * D, 8 * D, 8 * D], -1)
        q, _ = lz.qk_norm_rope_cache(
            q.view(1, HQ, D),
            k.view(1, 8, D),
            v.view(1, 8, D),
            self.qw,
            self.kw,
            self.cos,
            self.sin,
            self.caches[i],
            self.slots,
            position_ids=self.pos,
            eps=1e-6,
        )
        o = paged.paged_decode(
            q,
            self.caches[i],
            self.bt,
            self.lens,
            D**-0.5,
            block_n=bn,
            num_stages=stages,
            num_warps=warps,
            num_splits=splits,
        )
        h = lz.linear(o.reshape(1, HQ * D), self.o_w[i])
        gu, res = lz.rms_norm_linear(h, self.nw, self.w_gu[i], eps=1e-6, residual=res)
        return lz.swiglu_linear(gu[:, :INTER], gu[:, INTER:], self.w_down[i])


def resources() -> list[str]:
    """Registers / spills / shared memory of every compiled variant of the decode layer's Triton kernels."""
    rows = []
    for mod in (_gemv_kernels, _paged_kernels, _rope_kernels):
        for name in dir(mod):
            fn = getattr(mod, name)
            caches = getattr(fn, "device_caches", None)
            if not caches:
                continue
            for dev_caches in caches.values():
                for kern in dev_caches[0].values():
                    md = kern.metadata
                    rows.append(
                        f"| {name} | {getattr(kern, 'n_regs', '?')} | {getattr(kern, 'n_spills', '?')} | "
                        f"{md.shared} | {md.num_warps} | {md.num_stages} |"
                    )
    return sorted(set(rows))


GEMV_GRID = [(8192, 4), (4096, 4), (16384, 4), (8192, 8), (16384, 8), (4096, 2), (8192, 2)]
"""(``prefetch_slab``, ``prefetch_warps``) of the ``triton.gemv`` knobs for every projection of the layer at
once (``--gemv-grid``)."""


def gemv_grid(ctx: int) -> list[str]:
    """The layer chain (paged default) with the prefetch kernel's slab size and warps varied."""
    m = Model(ctx)
    rows = []
    for slab, warps in GEMV_GRID:
        with set_knobs(tg.KNOBS, prefetch_slab=slab, prefetch_warps=warps):
            us = chain_us(lambda i: m.layer(i, KNOBS[0]))
        rows.append(f"| {ctx} | gemv slab {slab}, {warps} warps | {us:.2f} | |")
        print(rows[-1], flush=True)
    return rows


def run(ctx: int) -> list[str]:
    m = Model(ctx)
    want = m.layer(0, KNOBS[0]).float()
    rows = []
    for knobs in KNOBS:
        got = m.layer(0, knobs).float()
        err = ((got - want).abs().max() / want.abs().max()).item()
        us = chain_us(lambda i, kn=knobs: m.layer(i, kn))
        label = (
            ", ".join(
                f"{n} {v}"
                for n, v in zip(("block_n", "stages", "warps", "splits"), knobs, strict=True)
                if v is not None
            )
            or "default"
        )
        rows.append(f"| {ctx} | {label} | {us:.2f} | {err:.2g} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="384,1024")
    ap.add_argument("--out", default=None)
    ap.add_argument("--gemv-grid", action="store_true", help="also vary the projections' slab size and warps")
    a = ap.parse_args()
    lines = [
        f"# Batch-1 decode layer chain, 28-layer graphs ({run_info()})",
        "",
        "| KV len | paged knobs | µs per layer | max rel diff vs default |",
        "| ---: | --- | ---: | ---: |",
    ]
    for ctx in (int(c) for c in a.contexts.split(",")):
        lines += run(ctx)
        if a.gemv_grid:
            lines += gemv_grid(ctx)
    lines += [
        "",
        "| kernel | registers | spills | shared bytes | warps | stages |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *resources(),
    ]
    print("\n".join(lines), flush=True)
    save_report(lines, a.out)


if __name__ == "__main__":
    main()
