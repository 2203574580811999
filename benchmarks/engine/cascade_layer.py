"""One layer's decode attention at the shared-prefix benchmark's shape, plain vs cascade, each captured in a
CUDA graph (GPU µs per call in a CUDA graph of 50 calls, best of 5 replays: ``bench_in_graph.graph_us``): 16
groups x 16 sequences (batch 256), 2048-token shared prefixes (128 blocks of 16), 130-350 own tokens each,
Qwen3-0.6B heads (16 q / 8 kv, D 128), bf16, block tables 150 wide. The cascade rows use the engine's layout:
every batch row is a group (the 16 real groups first, then 240 empty ones), as the engine's cascade graphs
pass them. Kernels as the decode graphs select them (``lz.capture_selection()``).

    python benchmarks/engine/cascade_layer.py [--groups 64 --members 4 --interleave]   # CUDA; µs per call

Results: benchmarks/results/engine/h200/2026-11-25c/cascade_layer_microbench.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import layerzero as lz
from layerzero.engine.layers.attention import cascade_attention
from layerzero.engine.worker.cascade import CascadeBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_in_graph's CUDA-graph timer
from bench_in_graph import graph_us  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="plain decode rows in arrival order (row i in group i %% groups), as the benchmark's "
        "interleaved requests run; default: a group's rows adjacent",
    )
    a = ap.parse_args(argv)
    page, hkv, hq, d, groups, members, width = 16, 8, 16, 128, a.groups, a.members, 150
    b = groups * members
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(
        groups * 128 + b * 24 + 10, 2, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g
    )
    prefix = torch.arange(groups * 128, dtype=torch.int32, device="cuda").view(groups, 128)
    own = groups * 128 + torch.arange(b * 22, dtype=torch.int32, device="cuda").view(b, 22)
    full = torch.zeros(b, width, dtype=torch.int32, device="cuda")
    full[:, :128], full[:, 128:150] = prefix.repeat_interleave(members, 0), own
    if a.interleave:  # row r = member r // groups of group r % groups
        full = full.view(groups, members, width).transpose(0, 1).reshape(b, width).contiguous()
    lens = (2048 + torch.randint(130, 350, (b,), device="cuda", generator=g)).to(torch.int32)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    suffix = torch.zeros(b, width, dtype=torch.int32, device="cuda")
    suffix[:, :22] = own
    plens = torch.zeros(b, dtype=torch.int32, device="cuda")
    plens[:groups] = 2048
    ptab = torch.zeros(b, width, dtype=torch.int32, device="cuda")
    ptab[:groups, :128] = prefix
    cu = torch.full((b + 1,), b, dtype=torch.int32, device="cuda")
    cu[: groups + 1] = torch.arange(groups + 1, device="cuda") * members
    c = CascadeBatch(torch.arange(b, device="cuda"), ptab, plens, cu, suffix, lens - 2048, 0)
    scale = d**-0.5
    with lz.capture_selection():
        print(
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {groups} groups x {members} "
            f"members, plain rows {'interleaved' if a.interleave else 'adjacent'}"
        )
        print(
            "plain decode (shared blocks, L2 reuse) "
            f"{graph_us(lambda: lz.paged_attention(q, cache, full, lens)):.1f} us"
        )
        print(f"cascade (whole layer op) {graph_us(lambda: cascade_attention(q, cache, c, scale)):.1f} us")
        own_us = graph_us(lambda: lz.paged_attention(q, cache, suffix, lens - 2048, return_lse=True))
        print(f"  level2 decode lse {own_us:.1f} us")
        shared_us = graph_us(
            lambda: lz.paged_attention(
                q, cache, ptab, plens, cu_seqlens_q=cu, is_causal=False, return_lse=True
            )
        )
        print(f"  level1 prefill lse {shared_us:.1f} us")
        o, lse = lz.paged_attention(q, cache, suffix, lens - 2048, return_lse=True)
        print(f"  merge {graph_us(lambda: lz.merge_attention_states(o, lse, o, lse)):.1f} us")


if __name__ == "__main__":
    main()
