"""``triton.paged_decode``'s split merge: one launch (the ``fused_merge`` knob, the split that counts last
merges) vs two (split kernel, then the merge kernel), side by side in one process.

- in a CUDA graph (what the engine's decode graphs pay; ``bench_in_graph.graph_us``: 50 calls per graph, best
  of 5 replays): B = 1, 2, 4, 8 sequences of 256 / 768 / 2048 tokens in a block table 2080 tokens wide
  (Qwen3-0.6B heads: 16 query / 8 KV of 128, bf16, pages of 16), the default split count;
- eager (host launch included; ``paged_spread.rounds_us``: rounds of back-to-back calls, CUDA events): the
  hidden check's unstable shape, B 24, mean 1500 tokens bimodal, 32 / 8 heads of 128 (its default split count
  3), plus one split (one launch, no merge) for scale.

Run it in several processes to see the process-to-process spread the H200 showed (``ship_timings/nvidia-h200/
paged_spread.md``). Usage: ``PYTHONPATH=src:benchmarks python benchmarks/bench_fused_merge.py [--rounds 8]``
(CUDA).
"""

from __future__ import annotations

import argparse

import torch
from _ship_grid import Case, build
from bench_in_graph import engine_decode_cases, graph_us
from paged_spread import rounds_table, rounds_us

from layerzero.backends.triton import paged
from layerzero.core.knobs import knobs


def _both(fn) -> tuple[float, float]:
    """``fn()`` timed with the two-kernel merge, then with the fused one."""
    out = []
    for fused in (False, True):
        with knobs(paged.KNOBS, fused_merge=fused, fused_merge_in_graphs=fused):
            out.append(fn())
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    print(f"# fused split merge on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("## in a CUDA graph (µs per call)\n\n| B | tokens | splits | two kernels | fused | fused / two |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for b, tokens, q, cache, tables, lens, splits in engine_decode_cases(dev, dt):
        two, fused = _both(
            lambda q=q, c=cache, t=tables, s=lens: graph_us(lambda: paged.paged_decode(q, c, t, s))
        )
        print(f"| {b} | {tokens} | {splits} | {two:.2f} | {fused:.2f} | {fused / two:.2f} |", flush=True)
    for case in (
        Case("paged_decode", 24, 1, 1500, 32, 8, 128, "bfloat16", 16, "bimodal", seed=2001),
        Case("paged_decode", 4, 1, 512, 16, 8, 128, "bfloat16", 16, "uniform", seed=2002),
    ):
        (q, kv, table, lens), _ = build(case, torch.device(dev))
        print(f"\n## eager, {case.label()} (µs per call, {a.rounds} rounds of {a.iters})\n")
        rows = []
        for fused in (False, True, False, True):
            with knobs(paged.KNOBS, fused_merge=fused):
                rows.append(
                    (
                        "fused" if fused else "two kernels",
                        rounds_us(
                            lambda q=q, kv=kv, t=table, s=lens: paged.paged_decode(q, kv, t, s),
                            a.rounds,
                            a.iters,
                        ),
                    )
                )
        rows.append(
            (
                "auto (the default)",
                rounds_us(
                    lambda q=q, kv=kv, t=table, s=lens: paged.paged_decode(q, kv, t, s), a.rounds, a.iters
                ),
            )
        )
        rows.append(
            (
                "one split (no merge)",
                rounds_us(
                    lambda q=q, kv=kv, t=table, s=lens: paged.paged_decode(q, kv, t, s, num_splits=1),
                    a.rounds,
                    a.iters,
                ),
            )
        )
        print("\n".join(rounds_table(rows, "form")))

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
