"""``triton.paged_decode``'s batch-1 tile rule (the ``small_batch`` knob: 32-position tiles, at most 16
splits; applied at any table width here) against the general rule (``tile_bytes``' 128-position tiles,
``max_splits``) over KV lengths the engine's A/B did not cover: 28-layer CUDA graphs of ``paged_decode`` alone
(each layer its own KV pool, PDL-launched on SM 9.0+), µs per layer (best of 7 replays), Qwen3-0.6B's
attention (16 query / 8 KV heads of 128, bf16, page 16), block tables 2048 and 40960 tokens wide (the engine
passes the width of its graphs: ``max_model_len``). Outputs of both rules are compared.

Variants beyond the tile rules (``VARIANTS``): one pass (the ``one_pass`` knob), warps.

Usage: ``PYTHONPATH=src:benchmarks:benchmarks/engine python benchmarks/engine/paged_small_batch.py [--contexts
512,1024,4096,16384] [--widths 2048,40960] [--variants NAME,...] [--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse

import torch
from gemv_prefetch import LAYERS, chain_us, run_info, save_report

import layerzero as lz
from layerzero.backends.triton import paged as tp
from layerzero.core.knobs import knobs

HQ, HKV, D, PAGE = 16, 8, 128, 16
VARIANTS: dict[str, dict[str, object]] = {
    "general": {"small_batch": None},
    "small": {"small_batch": (1, 1 << 30, 32, 16)},
    "32/32": {"small_batch": (1, 1 << 30, 32, 32)},
    "64/32": {"small_batch": (1, 1 << 30, 64, 32)},
    "small-1p": {"small_batch": (1, 1 << 30, 32, 16), "one_pass": True},
    "small-1p-8w": {"small_batch": (1, 1 << 30, 32, 16), "one_pass": True, "split_warps": 8},
    "32/32-1p": {"small_batch": (1, 1 << 30, 32, 32), "one_pass": True},
    "32/32-1p-early": {"small_batch": (1, 1 << 30, 32, 32), "one_pass": True, "early_kv": True},
    "64/16-1p": {"small_batch": (1, 1 << 30, 64, 16), "one_pass": True},
}
"""``triton.paged_decode`` knobs per variant (``--variants``: names, comma-separated; default the first four):
``general`` (128-position tiles, at most 32 splits), ``small`` (``small_batch``'s 32 / 16), ``32/32`` and
``64/32`` (tile / most splits), ``-1p`` (``one_pass``: a split's tiles gathered at once where it has at most
4), ``-8w`` (8 warps a split program), ``-early`` (``early_kv`` on: K / V but the newest read before the PDL
wait); every other knob as in force."""


def run(ctx: int, width: int, variants: list[str]) -> list[str]:
    g = torch.Generator(device="cuda").manual_seed(0)
    nblk = -(-ctx // PAGE)
    caches = [
        lz.allocate_kv_cache(nblk + 1, PAGE, HKV, D, torch.bfloat16, device="cuda") for _ in range(LAYERS)
    ]
    for c in caches:
        c.normal_(generator=g)
    q = [torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(LAYERS)]
    bt = torch.zeros(1, width // PAGE, dtype=torch.int32, device="cuda")
    bt[0, :nblk] = torch.arange(nblk, dtype=torch.int32, device="cuda")
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")

    def layer(i: int) -> torch.Tensor:
        return tp.paged_decode(q[i], caches[i], bt, lens, D**-0.5)

    rows, want = [], None
    for name in variants:
        with knobs(tp.KNOBS, **VARIANTS[name]):  # the plans are made afresh under them
            got = layer(0).float()
            want = got if want is None else want
            err = (got - want).abs().max().item()
            rows.append(f"| {ctx} | {width} | {name} | {chain_us(layer):.2f} | {err:.2g} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,1024,4096,16384")
    ap.add_argument("--widths", default="2048,40960", help="block-table widths in tokens")
    ap.add_argument("--variants", default=",".join(list(VARIANTS)[:4]))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    variants = a.variants.split(",")
    lines = [
        f"# triton.paged_decode at batch 1: tile rules, 28-layer graphs ({run_info()})",
        "",
        f"| KV len | table width | variant | µs per layer | max abs diff vs {variants[0]} |",
        "| ---: | ---: | --- | ---: | ---: |",
    ]
    for ctx in (int(c) for c in a.contexts.split(",")):
        for width in (int(w) for w in a.widths.split(",")):
            if ctx <= width:
                lines += run(ctx, width, variants)
    print("\n".join(lines), flush=True)
    save_report(lines, a.out)


if __name__ == "__main__":
    main()
