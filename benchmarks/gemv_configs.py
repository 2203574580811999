"""Launch-config search for ``triton.gemv`` (``backends/triton/gemv.py::config`` was set from it): both
kernels of ``_gemv_kernels.py`` over a grid of tile sizes, timed inside CUDA graphs
(``bench_in_graph.graph_us``) on Qwen3-0.6B's projections, next to cuBLAS. Prints, per (projection, rows),
cuBLAS and the best config of each kernel.

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/gemv_configs.py [--rows 2,4,8] [--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from bench_in_graph import LINEAR, graph_us

from layerzero.backends.triton import _gemv_kernels as kern
from layerzero.backends.triton._common import cdiv, next_pow2


def grid() -> list[tuple[str, dict]]:
    rows = [
        ("rows", {"BN": bn, "BK": bk, "num_warps": w})
        for bn, bk, w in itertools.product((2, 4, 8), (256, 512), (4, 8))
    ]
    dot = [
        ("dot", {"BN": bn, "BK": bk, "num_warps": 4, "num_stages": st})
        for bn, bk, st in itertools.product((16, 32, 64), (64, 128, 256), (3, 4))
    ]
    return rows + dot


def run(x, w, kind, cfg):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fn = kern._gemv_rows if kind == "rows" else kern._gemv_dot
    extra = {"BM": next_pow2(m)} if kind == "rows" else {"BM": 16, "UPCAST": False}
    fn[(cdiv(n, cfg["BN"]),)](
        x, w, out, out, m, n, x.stride(0), w.stride(0), out.stride(0), K=k, HAS_BIAS=False, **extra, **cfg
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = [
        f"# triton.gemv configs on {torch.cuda.get_device_name()} (bf16, in-graph µs)",
        "",
        "| proj | M | cuBLAS | best rows | config | best dot | config |",
        "| --- | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for name, (n, k) in LINEAR.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ w.double().t()
            best = {"rows": (float("inf"), None), "dot": (float("inf"), None)}
            for kind, cfg in grid():
                try:
                    y = run(x, w, kind, cfg)
                    if ((y.double() - ref).abs().max() / ref.abs().max()).item() > 1e-2:
                        print("wrong", name, m, kind, cfg)
                        continue
                    t = graph_us(lambda kind=kind, cfg=cfg, x=x, w=w: run(x, w, kind, cfg))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                    print("skip", kind, cfg, type(exc).__name__)
                    continue
                if t < best[kind][0]:
                    best[kind] = (t, cfg)
            cub = graph_us(lambda x=x, w=w: F.linear(x, w))
            lines.append(
                f"| {name} | {m} | {cub:.2f} | {best['rows'][0]:.2f} | {best['rows'][1]} | "
                f"{best['dot'][0]:.2f} | {best['dot'][1]} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
