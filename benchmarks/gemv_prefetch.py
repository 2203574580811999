"""``triton.gemv``'s prefetch kernel against its row / dot kernels and cuBLAS, the way a decode graph runs
them: a CUDA graph of 28 layers of ``lz.rms_norm -> linear`` (each layer its own weight, so the weights stream
from HBM as in a model, not from L2), PDL-launched where our kernels allow it (SM 9.0+, captured). Reports µs
per layer with the norm alone's chain subtracted (the projection's share of a step) and the fraction of the
copy bandwidth that share reaches; a grid of the prefetch kernel's slab width (BN) and warps for one row.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/gemv_prefetch.py [--rows 1,2,4,8] [--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_in_graph import LINEAR

import layerzero as lz
from layerzero.backends.triton import gemv as tg
from layerzero.core.knobs import knobs

LAYERS = 28


def chain_us(fn: Callable[[int], object], flush: torch.Tensor | None = None) -> float:
    """µs per layer of a graph of ``LAYERS`` calls ``fn(layer)`` (warmed under ``lz.capture_selection()`` so
    PDL variants compile before the capture; best of 7 replays); ``flush``: a buffer zeroed before each replay
    (bigger than L2: every weight then comes from HBM)."""
    with lz.capture_selection():
        for i in range(LAYERS):
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(LAYERS):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(7):
        if flush is not None:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / LAYERS)
    return best


def run_info() -> str:
    """``GPU, torch version, Python version, date`` for a report's title."""
    return (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{datetime.date.today()}"
    )


def save_report(lines: list[str], out: str | None) -> None:
    """Write a report's markdown ``lines`` to ``out`` (a path; None: nowhere)."""
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes/s) of a 1 GiB buffer (read + write counted)."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        b.copy_(a)
    ev[1].record()
    torch.cuda.synchronize()
    return 2 * 2**30 * 10 / (ev[0].elapsed_time(ev[1]) / 1000)


def measure(name: str, ws: list[torch.Tensor], nw: torch.Tensor, m: int, bw: float) -> str:
    """One table row: the ``m``-row chains of projection ``name`` (weights ``ws``, norm weight ``nw``)."""
    n, k = ws[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def layer(i: int, lin: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return lin(lz.rms_norm(x, nw, 1e-6), ws[i])

    norm = chain_us(lambda i: lz.rms_norm(x, nw, 1e-6))
    cub = chain_us(lambda i: layer(i, F.linear)) - norm

    def ours(prefetch: bool, bn: int | None = None, warps: int = 4) -> float:
        fields = dict(prefetch=prefetch, prefetch_warps=warps)
        if bn is not None:
            fields["prefetch_slab"] = bn * (1 << (k - 1).bit_length())
        with knobs(tg.KNOBS, **fields):
            h = lz.rms_norm(x, nw, 1e-6)
            y, want = tg.gemv(h, ws[0], None), h.double() @ ws[0].double().t()
            if ((y.double() - want).abs().max() / want.abs().max()).item() > 1e-2:
                raise RuntimeError(f"wrong result {name} M={m} prefetch={prefetch} BN={bn} warps={warps}")
            return chain_us(lambda i: layer(i, lambda h, w: tg.gemv(h, w, None))) - norm

    base, dflt = ours(False), ours(True)
    grid = (
        [(bn, w) for bn in (1, 2, 4, 8) for w in (4, 8) if bn * (1 << (k - 1).bit_length()) <= 16384]
        if m == 1
        else [(bn, 4) for bn in (2, 4, 8)]
    )
    best: tuple[float, str | None] = (float("inf"), None)
    for bn, w in grid:
        try:
            t = ours(True, bn, w)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or is wrong is named, skipped
            print("skip", name, m, bn, w, type(exc).__name__, str(exc)[:120], flush=True)
            continue
        best = min(best, (t, f"BN {bn}, {w} warps"), key=lambda p: p[0])

    def frac(us: float) -> str:
        return f"{us:.2f} ({n * k * 2 / (us * 1e-6) / bw:.2f})"

    return (
        f"| {name} | {m} | {norm:.2f} | {frac(cub)} | {frac(base)} | {frac(dflt)} | {frac(best[0])} | "
        f"{best[1]} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    lines = [
        f"# triton.gemv prefetch kernel, {torch.cuda.get_device_name()} (bf16, {LAYERS}-layer norm -> linear "
        "graphs, PDL)",
        "",
        f"torch {torch.__version__}, host {platform.processor() or platform.machine()}; copy bandwidth "
        f"{bw / 1e12:.2f} TB/s. µs per layer, the norm-only chain subtracted; (x) = fraction of the copy "
        "bandwidth the projection's weight read reaches in that time.",
        "",
        "| proj | M | norm alone | cuBLAS | rows/dot (prefetch off) | prefetch (default cfg) | best prefetch "
        "| cfg |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    print("\n".join(lines), flush=True)
    for name, (n, k) in LINEAR.items():
        if name == "lm_head":
            continue
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)]
        nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for m in (int(r) for r in a.rows.split(",")):
            lines.append(measure(name, ws, nw, m, bw))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
