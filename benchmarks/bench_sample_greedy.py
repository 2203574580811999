"""Greedy decoding's argmax on CUDA: ``lz.sample_greedy`` (``triton.sample_greedy``: the split-vocabulary
argmax on the bf16 logits) against ``torch.argmax(logits.float())`` (the serving engine's greedy path before
it: a float32 cast, then the argmax) and ``torch.argmax(logits)`` on the bf16 logits, vocabulary 151,936
(Qwen's), S = 1, 8, 64, 256 rows. Each is timed as a serving step runs it: inside a CUDA graph of 100
back-to-back calls (the host's launch cost is paid once, at capture), median of 7 replays, µs per call; the
Triton kernel with PDL (as a decode graph launches it on SM >= 9.0 for <= 16 rows: consecutive calls overlap
their launch with the previous call's tail) and without. The logits (0.3 MB a row) stay in L2 between replays,
as a step's logits just written by the LM head do. Every kernel's ids are checked against
``reference.sample_greedy`` first.

Usage (on a GPU machine)::

    PYTHONPATH=src python benchmarks/bench_sample_greedy.py --out benchmarks/results/sample_greedy_h100.md
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from gemv_prefetch import run_info, save_report

import layerzero as lz
from layerzero.backends.reference import sampling as ref
from layerzero.backends.triton import _launch
from layerzero.backends.triton import sampling as ts
from layerzero.core import knobs

CALLS = 100
REPLAYS = 7


def graph_us(fn: Callable[[], Any]) -> float:
    """µs per call of ``fn`` in a CUDA graph of :data:`CALLS` calls (median of :data:`REPLAYS` replays), after
    PyTorch's recipe: an eager call, a warm-up under ``lz.capture_selection()`` (compiles what the capture
    runs, PDL variants included), a side-stream warm-up, the capture."""
    fn()
    with lz.capture_selection():
        fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / CALLS)
    return statistics.median(times)


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].flatten().tolist()
        raise RuntimeError(f"{name}: ids differ from reference.sample_greedy at rows {bad}")


def measure(s: int, v: int, dtype: torch.dtype) -> str:
    """One table row: ``s`` rows of ``v`` logits."""
    g = torch.Generator(device="cuda").manual_seed(s)
    x = (torch.randn(s, v, generator=g, device="cuda") * 3).to(dtype)
    want = ref.sample_greedy(x)
    _check("lz.sample_greedy", lz.sample_greedy(x), want)
    _check("torch.argmax(logits.float())", torch.argmax(x.float(), dim=-1), want)
    _check("torch.argmax(logits)", torch.argmax(x, dim=-1), want)
    if lz.which("sample_greedy", x) != "triton.sample_greedy":
        raise RuntimeError(f"lz.sample_greedy runs {lz.which('sample_greedy', x)}, not triton.sample_greedy")
    with knobs.knobs(_launch.KNOBS, pdl=True):
        tri_pdl = graph_us(lambda: lz.sample_greedy(x))
    with knobs.knobs(_launch.KNOBS, pdl=False):
        tri = graph_us(lambda: lz.sample_greedy(x))
    cast = graph_us(lambda: torch.argmax(x.float(), dim=-1))
    direct = graph_us(lambda: torch.argmax(x, dim=-1))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chunks, _ = ts.greedy_chunks(s, v, knobs.get(ts.KNOBS).greedy_programs_per_sm * sms)
    pdl = (
        "yes"
        if s <= knobs.get(_launch.KNOBS).pdl_max_rows and torch.cuda.get_device_capability()[0] >= 9
        else "no (not used)"
    )
    return (
        f"| {s} | {v} | {chunks} | {tri_pdl:.2f} ({pdl}) | {tri:.2f} | {cast:.2f} | {direct:.2f} | "
        f"{cast / min(tri, tri_pdl):.2f}x |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="1,8,64,256", help="comma-separated row counts S")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kn = knobs.get(ts.KNOBS)
    lines = [
        f"# Greedy argmax: triton.sample_greedy vs torch.argmax — {run_info()}",
        "",
        f"- triton {triton.__version__}, {sms} SMs; bf16 logits, vocabulary {args.vocab}; µs per call inside "
        f"a CUDA graph of {CALLS} calls, median of {REPLAYS} replays; tile {kn.greedy_block}, "
        f"{kn.greedy_programs_per_sm} programs per SM aimed at (chunks: per row, 1 = no merge launch)",
        "",
        "| S | V | chunks | triton (PDL) µs | triton µs | argmax(logits.float()) µs | argmax(bf16) µs | "
        "speed-up vs cast + argmax |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in (int(r) for r in args.rows.split(",")):
        lines.append(measure(s, args.vocab, torch.bfloat16))
        print(lines[-1], flush=True)
    print("\n".join(lines))
    save_report(lines, args.out)


if __name__ == "__main__":
    main()
