"""``lz.sample`` kernels side by side on CUDA: ``reference.sample`` vs ``triton.sample`` (each forced with
``lz.lock``), a serving engine's sampling step (temperature only, then temperature + top-p), bf16 logits at a
real vocabulary. Median of interleaved rounds (CUDA events around a burst of calls), µs per call, and the
fraction of the device's copy bandwidth the Triton kernel reaches on its two reads of the logits.

Usage (on a GPU machine)::

    PYTHONPATH=src python benchmarks/bench_sample.py --out benchmarks/results/sample_h200.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import torch

import layerzero as lz

KERNELS = ("reference.sample", "triton.sample")


def _time_us(fn, calls: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _copy_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    us = min(_time_us(lambda: dst.copy_(src), 5) for _ in range(3))
    return 2 * nbytes / us / 1e3  # read + write, GB/s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    bw = _copy_gbs()
    lines = [
        f"# lz.sample kernels on {torch.cuda.get_device_name()} — {datetime.date.today()}",
        "",
        f"- torch {torch.__version__}, vocab {args.vocab}, bf16 logits; median of {args.rounds} interleaved "
        f"rounds of 20 calls; copy bandwidth {bw:.0f} GB/s",
        "",
        "| batch | filters | reference.sample µs | triton.sample µs | speed-up | triton: two reads of the "
        "logits at % of copy bandwidth |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for b in (1, 64, 256):
        logits = torch.randn(b, args.vocab, device="cuda", dtype=torch.bfloat16)
        temp = torch.full((b,), 0.6, device="cuda")
        for name, kw in (
            ("temperature", {}),
            ("temperature + top-p 0.9", {"top_p": torch.full((b,), 0.9, device="cuda")}),
        ):
            times: dict[str, list[float]] = {k: [] for k in KERNELS}
            for _ in range(args.rounds):
                for k in KERNELS:
                    lz.lock("sample", k)
                    try:
                        lz.sample(logits, temperature=temp, **kw)
                        times[k].append(
                            _time_us(lambda x=logits, t=temp, kw=kw: lz.sample(x, temperature=t, **kw))
                        )
                    finally:
                        lz.unlock("sample")
            ref, tri = (statistics.median(times[k]) for k in KERNELS)
            frac = 2 * logits.numel() * 2 / (tri * 1e-6) / (bw * 1e9)  # bytes read / s over copy bytes / s
            lines.append(
                f"| {b} | {name} | {ref:.1f} | {tri:.1f} | {ref / tri:.2f}x | "
                + ("-" if kw else f"{100 * frac:.0f}%")
                + " |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
