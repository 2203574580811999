"""``lz.apply_token_bitmask`` kernels side by side: each eligible kernel locked in turn on float32 logits of
vocabulary 151,936 (Qwen's; W = 4,748 words), the step shapes of issue 39's structured-output benchmark: 64 of
64 rows masked (``indices=None``) and 64 of 128 rows (indices), plus 8 of 8. Timed as the sampler runs it,
eagerly: the wall time of 200 back-to-back calls with one synchronize at the end (host launch cost and device
time, whichever bounds), µs per call, median of 5 repeats. Each kernel's result is checked against
``torch_native.apply_token_bitmask`` first (bit for bit).

Usage (on a GPU machine; ``--device cpu --vocab 4099`` is a smoke run)::

    PYTHONPATH=src python benchmarks/bench_token_bitmask.py \
        --out benchmarks/results/decoding/token_bitmask_h200.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import layerzero as lz

OP = "apply_token_bitmask"
KERNELS = (
    "triton.apply_token_bitmask",
    "xgrammar.apply_token_bitmask",
    "torch_native.apply_token_bitmask",
)
CALLS, REPEATS = 200, 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_us(kernel_id: str, logits: torch.Tensor, bits: torch.Tensor, idx: torch.Tensor | None) -> float:
    """µs per call of ``kernel_id`` (locked), eager, median of :data:`REPEATS` runs of :data:`CALLS`."""
    lz.lock(OP, kernel_id)
    try:
        lz.apply_token_bitmask(logits, bits, idx)
        _sync(logits.device)
        runs = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            for _ in range(CALLS):
                lz.apply_token_bitmask(logits, bits, idx)
            _sync(logits.device)
            runs.append((time.perf_counter() - t0) * 1e6 / CALLS)
        return statistics.median(runs)
    finally:
        lz.unlock(OP)


def rows_for(shape: tuple[int, int], vocab: int, device: torch.device) -> list[str]:
    """Table rows of one (rows masked, logits rows) shape: one per eligible kernel."""
    masked, n_all = shape
    g = torch.Generator(device=device).manual_seed(masked * 1000 + n_all)
    width = -(-vocab // 32)
    logits = torch.randn(n_all, vocab, generator=g, device=device)
    bits = torch.randint(-(2**31), 2**31, (masked, width), generator=g, device=device, dtype=torch.int64)
    bits = bits.to(torch.int32)
    idx = None if masked == n_all else torch.randperm(n_all, generator=g, device=device)[:masked]
    want = logits.clone()
    lz.lock(OP, "torch_native.apply_token_bitmask")
    lz.apply_token_bitmask(want, bits, idx)
    lz.unlock(OP)
    out = []
    for k in KERNELS:
        reasons = lz.validate(k, OP, logits, bits, idx)
        if reasons:
            out.append(f"| {masked} of {n_all} | `{k}` | not eligible: {reasons[0].code.value} | |")
            continue
        got = logits.clone()
        lz.lock(OP, k)
        lz.apply_token_bitmask(got, bits, idx)
        lz.unlock(OP)
        same = torch.equal(got.view(torch.int32), want.view(torch.int32))
        us = time_us(k, logits.clone(), bits, idx)
        out.append(f"| {masked} of {n_all} | `{k}` | {us:.1f} | {'yes' if same else 'NO'} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    a = ap.parse_args()
    device = torch.device(a.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    lines = [
        f"lz.apply_token_bitmask, {name}, torch {torch.__version__}, float32 logits, V = {a.vocab}",
        "",
        "| rows masked | kernel | µs per call (eager) | equals torch_native |",
        "| --- | --- | ---: | --- |",
    ]
    for shape in ((64, 64), (64, 128), (8, 8)):
        lines += rows_for(shape, a.vocab, device)
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
