"""int4 decode GEMV (``triton.quantized_linear``'s ``_qgemv_int4``) against bf16 ``triton.gemv``, its old int4
row kernel (``_qgemv_rows``, knob ``int4_decode=False``) and dequantize + cuBLAS
(``torch_native.quantized_linear``), the way a decode graph runs them: for each Qwen3-0.6B projection a CUDA
graph of 28 layers of ``lz.rms_norm -> linear`` (each layer its own weight; PDL-launched where our kernels
allow it: SM 9.0+, captured), L2 flushed before every timed replay so that each weight comes from HBM as in a
model (28 int4 weights of the attention output projection are 28 MiB and would otherwise stay in L2 between
replays). Reports µs per projection (the norm-only chain subtracted, the projection's share of a step) and, in
brackets, the fraction of the device-to-device copy bandwidth that the weight's stored bytes reach in that
time (bf16: 2 bytes an element; int4: codes, scales and zero points, also for dequantize + cuBLAS, which reads
them and then writes and reads a bf16 copy). ``--grid``: the int4 kernel's ``(slab codes, warps)``
(knob ``int4_by_shape``) swept per projection and rows, the best reported (what to put in
``QuantizedLinearKnobs.int4_configs``).

Usage (CUDA): ``PYTHONPATH=src:benchmarks python benchmarks/bench_int4_gemv.py [--rows 1,2,4,8] [--group 128]
[--grid] [--out benchmarks/results/int4_gemv_h200.md]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_in_graph import LINEAR
from gemv_prefetch import LAYERS, chain_us, copy_bandwidth, run_info, save_report

import layerzero as lz
from layerzero.backends.torch_native.quantize import quantized_linear as dequant_cublas
from layerzero.backends.triton import gemv as tg
from layerzero.backends.triton import quantized_linear as tq
from layerzero.core.knobs import get, knobs
from layerzero.testing.quant_oracle import oracle_weight

FLUSH_BYTES = 256 << 20
"""Bytes written before each timed replay (over 2x the L2 of an H100 / H200)."""
GRID = [(slab, warps) for slab in (2048, 4096, 8192, 12288, 16384, 32768) for warps in (1, 2, 4, 8)]


def int4_bytes(qt: lz.QuantizedTensor) -> int:
    """Stored bytes of an int4 weight: codes, float32 scales, uint8 zero points."""
    return qt.data.numel() + qt.scale.numel() * 4 + qt.zero_point.numel()


def _check(name: str, y: torch.Tensor, want: torch.Tensor) -> None:
    """Raise RuntimeError naming ``name`` when ``y`` is off the float64 ``want`` by more than 1e-2 of its
    range."""
    err = ((y.double() - want).abs().max() / want.abs().max()).item()
    if err > 1e-2:
        raise RuntimeError(f"{name}: wrong result (relative error {err:.2e})")


def with_knobs(fn: Callable[[], float], **fields: object) -> float:
    """``fn()`` with ``"triton.quantized_linear"``'s knobs ``fields`` changed (restored afterwards)."""
    with knobs(tq.KNOBS, **fields):
        return fn()


def measure(
    name: str, n: int, k: int, group: int, rows: list[int], grid: bool, bw: float, flush: torch.Tensor
) -> list[str]:
    """Table rows of one projection ``[n, k]`` (its ``LAYERS`` weights made here)."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS)]
    qts = [lz.quantize(w, "int4", group_size=group) for w in ws]
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    return [measure_rows(name, ws, qts, nw, m, grid, bw, flush) for m in rows]


def measure_rows(
    name: str,
    ws: list[torch.Tensor],
    qts: list[lz.QuantizedTensor],
    nw: torch.Tensor,
    m: int,
    grid: bool,
    bw: float,
    flush: torch.Tensor,
) -> str:
    """One table row: ``m`` rows through the chains of every variant, each checked against float64 first."""
    n, k = ws[0].shape
    group = qts[0].group_size
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    h0 = lz.rms_norm(x, nw, 1e-6)
    _check(f"{name} bf16", tg.gemv(h0, ws[0], None), h0.double() @ ws[0].double().t())
    want4 = h0.double() @ oracle_weight(qts[0]).t()
    _check(f"{name} int4 new", tq.quantized_linear(h0, qts[0], None), want4)
    _check(
        f"{name} int4 old",
        with_knobs(lambda: tq.quantized_linear(h0, qts[0], None), int4_decode=False),
        want4,
    )
    _check(f"{name} dequant", dequant_cublas(h0, qts[0], None), want4)

    def chain(lin: Callable[[torch.Tensor, int], torch.Tensor]) -> float:
        return chain_us(lambda i: lin(lz.rms_norm(x, nw, 1e-6), i), flush)

    def int4_chain() -> float:
        return chain(lambda h, i: tq.quantized_linear(h, qts[i], None))

    norm = chain_us(lambda i: lz.rms_norm(x, nw, 1e-6), flush)
    bf16 = chain(lambda h, i: tg.gemv(h, ws[i], None)) - norm
    new = int4_chain() - norm
    old = with_knobs(int4_chain, int4_decode=False) - norm
    deq = chain(lambda h, i: dequant_cublas(h, qts[i], None)) - norm
    best = "-"
    if grid:
        found: tuple[float, str] = (new, "default")
        for slab, warps in GRID:
            try:
                t = with_knobs(int4_chain, int4_by_shape=(((n, k), (slab, warps)),)) - norm
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is named and skipped
                print("skip", name, m, slab, warps, type(exc).__name__, str(exc)[:120], flush=True)
                continue
            if t < found[0]:
                found = (t, f"slab {slab}, {warps} warps")
        best = f"{found[0]:.2f} ({found[1]})"

    def cell(us: float, nbytes: int) -> str:
        return f"{us:.2f} ({nbytes / (us * 1e-6) / bw:.2f})"

    bf16_b, int4_b = n * k * 2, int4_bytes(qts[0])
    cfg = tq.config(m, n, k, group)
    row = (
        f"| {name} ({n} x {k}) | {m} | {norm:.2f} | {cell(bf16, bf16_b)} | {cell(new, int4_b)} | "
        f"{cell(old, int4_b)} | {cell(deq, int4_b)} | {bf16 / new:.2f} | "
        f"BN {cfg['BN']}, {cfg['num_warps']} warps | {best} |"
    )
    print(row, flush=True)
    return row


def main() -> int:
    """Parse the arguments, measure every projection (not the LM head), write the report; 1 without a CUDA
    GPU."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1", help="comma-separated row counts (1-8)")
    ap.add_argument("--group", type=int, default=128, help="int4 group size along K")
    ap.add_argument("--grid", action="store_true", help="sweep the int4 kernel's (slab, warps) per shape")
    ap.add_argument("--out", default=None, help="markdown report path")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_int4_gemv.py needs a CUDA GPU")
        return 1
    import triton

    rows = [int(r) for r in a.rows.split(",")]
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    bw = copy_bandwidth()
    kn = get(tq.KNOBS)
    lines = [
        f"# int4 decode GEMV vs bf16 triton.gemv ({run_info()})",
        "",
        f"triton {triton.__version__}, SM {'.'.join(map(str, torch.cuda.get_device_capability()))}; "
        f"{LAYERS}-layer rms_norm -> linear graphs (PDL where our kernels allow it), L2 flushed before each "
        f"replay, best of 7; int4 groups of {a.group}; copy bandwidth {bw / 1e12:.2f} TB/s. µs per "
        "projection, the norm-only chain subtracted; (x) = fraction of the copy bandwidth that the weight's "
        "stored bytes reach (bf16: 2 B / element; int4: codes + scales + zero points for all three int4 "
        f"columns). int4 kernel configs: int4_configs = {kn.int4_configs}, int4_loop_config = "
        f"{kn.int4_loop_config}, int4_chunk_k = {kn.int4_chunk_k}, int4_by_shape = {kn.int4_by_shape}.",
        "",
        "| proj | M | norm alone | bf16 triton.gemv | int4 decode (_qgemv_int4) | int4 old rows "
        "(_qgemv_rows) | int4 dequantize + cuBLAS | bf16 / int4 decode | int4 cfg | best int4 (--grid) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    for name, (n, k) in LINEAR.items():
        if name != "lm_head":
            lines += measure(name, n, k, a.group, rows, a.grid, bw, flush)
            torch.cuda.empty_cache()
    save_report(lines, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
