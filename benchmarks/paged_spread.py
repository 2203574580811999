"""Run-to-run spread of the paged-decode kernels on one hidden shape (default: the H200 check's B24 bimodal,
whose ``triton.paged_decode`` time read 69 µs in one run and 110 µs in the next on one machine).

For each kernel (and ``triton.paged_decode`` at forced split counts) it times ``--rounds`` rounds of
``--iters`` back-to-back eager calls with CUDA events, and prints each round's µs per call, so a bimodal
kernel shows as rounds that jump. Usage: ``PYTHONPATH=src:benchmarks python benchmarks/paged_spread.py`` (CUDA
only).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _ship_grid import Case, build

import layerzero as lz


def rounds_us(fn, rounds: int, iters: int) -> list[float]:
    """µs per call of ``fn`` in each of ``rounds`` rounds of ``iters`` calls (CUDA events)."""
    for _ in range(10):
        fn()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1000 / iters)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--mean", type=int, default=1500)
    ap.add_argument("--dist", default="bimodal")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    from layerzero.backends.triton import paged as tp

    case = Case("paged_decode", a.batch, 1, a.mean, 32, 8, 128, "bfloat16", 16, a.dist, seed=2001)
    args, kwargs = build(case, torch.device("cuda"))
    q, cache, table, lens = args
    rows = []
    for kid in ("flashinfer.paged_attention", "triton.paged_decode"):
        lz.lock("paged_attention", kid)
        try:
            rows.append(
                (kid, rounds_us(lambda: lz.paged_attention(q, cache, table, lens), a.rounds, a.iters))
            )
        except lz.LayerZeroError as exc:
            print(kid, "unavailable:", exc)
        finally:
            lz.unlock("paged_attention")
    for s in (1, 2, 3, 4, 6, 8):
        rows.append(
            (
                f"triton splits={s}",
                rounds_us(
                    lambda s=s: tp.paged_decode(q, cache, table, lens, num_splits=s), a.rounds, a.iters
                ),
            )
        )
    print(
        f"# {case.label()} on {torch.cuda.get_device_name()}: µs per call, {a.rounds} rounds of {a.iters}\n"
    )
    print("\n".join(rounds_table(rows, "kernel")))
    return 0


def rounds_table(rows: list[tuple[str, list[float]]], what: str) -> list[str]:
    """Markdown lines of ``(name, per-round µs)`` rows: min, median, max and every round."""
    return [f"| {what} | min | median | max | rounds |", "| --- | ---: | ---: | ---: | --- |"] + [
        f"| {name} | {min(r):.1f} | {statistics.median(r):.1f} | {max(r):.1f} | "
        + " ".join(f"{x:.0f}" for x in r)
        + " |"
        for name, r in rows
    ]


if __name__ == "__main__":
    raise SystemExit(main())
