"""``triton.paged_decode``'s batch-1 tile rule (``paged.SMALL_BATCH``: 32-position tiles, at most 16 splits; applied at
any table width here) against the
general rule (``TILE_BYTES``' 128-position tiles, ``MAX_SPLITS``) over KV lengths the engine's A/B did not cover:
28-layer CUDA graphs of ``paged_decode`` alone (each layer its own KV pool, PDL-launched on SM 9.0+), µs per layer
(best of 7 replays), Qwen3-0.6B's attention (16 query / 8 KV heads of 128, bf16, page 16), block tables 2048 and 40960
tokens wide (the engine passes the width of its graphs: ``max_model_len``). Outputs of both rules are compared.

Variants beyond the tile rules (``VARIANTS``): one pass (``paged.ONE_PASS``), warps.

Usage: ``PYTHONPATH=src:benchmarks:benchmarks/engine python benchmarks/engine/paged_small_batch.py [--contexts
512,1024,4096,16384] [--widths 2048,40960] [--variants NAME,...] [--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse

import torch
from gemv_prefetch import LAYERS, chain_us, run_info, save_report

import layerzero as lz
from layerzero.backends.triton import paged as tp

HQ, HKV, D, PAGE = 16, 8, 128, 16
VARIANTS: dict[str, dict[str, object]] = {
    "general": {"SMALL_BATCH": None},
    "small": {"SMALL_BATCH": (1, 1 << 30, 32, 16)},
    "32/32": {"SMALL_BATCH": (1, 1 << 30, 32, 32)},
    "64/32": {"SMALL_BATCH": (1, 1 << 30, 64, 32)},
    "small-1p": {"SMALL_BATCH": (1, 1 << 30, 32, 16), "ONE_PASS": True},
    "small-1p-8w": {"SMALL_BATCH": (1, 1 << 30, 32, 16), "ONE_PASS": True, "SPLIT_WARPS": 8},
    "32/32-1p": {"SMALL_BATCH": (1, 1 << 30, 32, 32), "ONE_PASS": True},
    "32/32-1p-early": {"SMALL_BATCH": (1, 1 << 30, 32, 32), "ONE_PASS": True, "EARLY_KV": True},
    "64/16-1p": {"SMALL_BATCH": (1, 1 << 30, 64, 16), "ONE_PASS": True},
}
"""Settings of ``paged`` per variant (``--variants``: names, comma-separated; default the first four): ``general``
(128-position tiles, at most 32 splits), ``small`` (``SMALL_BATCH``'s 32 / 16), ``32/32`` and ``64/32`` (tile / most
splits), ``-1p`` (``ONE_PASS``: a split's tiles gathered at once where it has at most 4), ``-8w`` (8 warps a split
program), ``-early`` (``EARLY_KV`` on: K / V but the newest read before the PDL wait); every other setting as the module has it."""


def run(ctx: int, width: int, variants: list[str]) -> list[str]:
    g = torch.Generator(device="cuda").manual_seed(0)
    nblk = -(-ctx // PAGE)
    caches = [lz.allocate_kv_cache(nblk + 1, PAGE, HKV, D, torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    for c in caches:
        c.normal_(generator=g)
    q = [torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    bt = torch.zeros(1, width // PAGE, dtype=torch.int32, device="cuda")
    bt[0, :nblk] = torch.arange(nblk, dtype=torch.int32, device="cuda")
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")

    def layer(i: int) -> torch.Tensor:
        return tp.paged_decode(q[i], caches[i], bt, lens, D ** -0.5)

    rows, want = [], None
    for name in variants:
        old = {k: getattr(tp, k) for k in VARIANTS[name]}
        try:
            for k, v in VARIANTS[name].items():
                setattr(tp, k, v)
            tp._PLANS.clear()
            got = layer(0).float()
            want = got if want is None else want
            err = (got - want).abs().max().item()
            rows.append(f"| {ctx} | {width} | {name} | {chain_us(layer):.2f} | {err:.2g} |")
            print(rows[-1], flush=True)
        finally:
            for k, v in old.items():
                setattr(tp, k, v)
            tp._PLANS.clear()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,1024,4096,16384")
    ap.add_argument("--widths", default="2048,40960", help="block-table widths in tokens")
    ap.add_argument("--variants", default=",".join(list(VARIANTS)[:4]))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    variants = a.variants.split(",")
    lines = [f"# triton.paged_decode at batch 1: tile rules, 28-layer graphs ({run_info()})", "",
             f"| KV len | table width | variant | µs per layer | max abs diff vs {variants[0]} |",
             "| ---: | ---: | --- | ---: | ---: |"]
    for ctx in (int(c) for c in a.contexts.split(",")):
        for width in (int(w) for w in a.widths.split(",")):
            if ctx <= width:
                lines += run(ctx, width, variants)
    print("\n".join(lines), flush=True)
    save_report(lines, a.out)


if __name__ == "__main__":
    main()
