"""Does a kernel cost the same per call whether the default choice, ``lz.lock`` or ``lz.prefer`` picked it?

For each shape: the default kernel K of the call, then the per-call time (eager, CUDA events around a loop of
calls, median of rounds) of the same call through (a) the default path, (b) ``lz.lock(op, K)``, (c)
``with lz.prefer(K)``, interleaved in rounds in one process, and (d) the default and (e) the locked path each
in a FRESH process (first-use effects: plan caches, JIT, specialization, allocator state). FlashInfer's plan
cache counters are reported next to each, since a re-plan per call would show there. Writes a markdown table.

Usage: ``python benchmarks/lock_cost.py --out DIR`` (CUDA; ``--device cpu`` runs the same on CPU for a check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import layerzero as lz

SHAPES = {
    "paged B1 KV8000": dict(op="paged_attention", lens=[8000]),
    "paged B8 ragged mean700": dict(op="paged_attention", lens=[120, 1500, 64, 900, 700, 333, 1200, 743]),
    "paged B64 KV1024": dict(op="paged_attention", lens=[1024] * 64),
    "dense cross q64 kv4096": dict(op="attention", b=4, sq=64, sk=4096),
    "dense decode kv2048": dict(op="attention", b=8, sq=1, sk=2048),
}


def make_call(name: str, device: str) -> tuple[str, Callable[[], object], tuple, dict]:
    """(op, zero-arg call, args, kwargs) of shape ``name`` (seeded; bf16 on CUDA, fp32 on CPU)."""
    spec = SHAPES[name]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    if spec["op"] == "paged_attention":
        lens, page, hq, hkv, d = spec["lens"], 16, 32, 8, 128
        per = [-(-n // page) for n in lens]
        width = max(per)
        cache = lz.allocate_kv_cache(sum(per) + 1, page, hkv, d, dtype=dtype, device=device)
        cache.normal_(generator=g)
        tables = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
        start = 1
        for i, n in enumerate(per):
            tables[i, :n] = torch.arange(start, start + n, device=device, dtype=torch.int32)
            start += n
        seq = torch.tensor(lens, dtype=torch.int32, device=device)
        args, kwargs = (rnd(len(lens), hq, d), cache, tables, seq), {}
        return "paged_attention", lambda: lz.paged_attention(*args), args, kwargs
    b, sq, sk, hq, hkv, d = spec["b"], spec["sq"], spec["sk"], 32, 8, 128
    args, kwargs = (rnd(b, hq, sq, d), rnd(b, hkv, sk, d), rnd(b, hkv, sk, d)), {}
    return "attention", lambda: lz.attention(*args), args, kwargs


ITERS = 100


def per_call_us(fn: Callable[[], object], device: str, iters: int | None = None) -> float:
    """Wall µs per call over ``iters`` calls, synchronized at both ends (launch + kernel, as a serving step
    sees)."""
    if device == "cuda":
        torch.cuda.synchronize()
    iters = iters or ITERS
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _plan_stats() -> str:
    from layerzero.core.runtime import RUNTIME

    try:
        from layerzero.backends.flashinfer import plan_stats
    except ImportError:
        return "-"
    stats = plan_stats(RUNTIME.registry)
    return "-" if stats is None else f"hits {stats.hits} misses {stats.misses}"


def measure(name: str, device: str, routes: list[str], rounds: int) -> dict[str, object]:
    """Median per-call µs of ``name`` through each route (interleaved rounds) plus the kernel and plan
    stats."""
    op, call, args, kwargs = make_call(name, device)
    kernel = lz.which(op, *args, **kwargs)

    def via(route: str) -> Callable[[], float]:
        if route == "lock":
            return _locked_loop(op, kernel, call)
        if route == "prefer":
            return _preferred_loop(kernel, call)
        return lambda: per_call_us(call, DEVICE)

    fns = {r: via(r) for r in routes}
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {r: [] for r in routes}
    for _ in range(rounds):
        for r, fn in fns.items():
            samples[r].append(fn())
    return {"kernel": kernel, **{r: statistics.median(v) for r, v in samples.items()}, "plans": _plan_stats()}


def _locked_loop(op: str, kernel: str, call: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        lz.lock(op, kernel)
        try:
            return per_call_us(call, DEVICE)
        finally:
            lz.unlock(op)

    return run


def _preferred_loop(kernel: str, call: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        with lz.prefer(kernel):
            return per_call_us(call, DEVICE)

    return run


DEVICE = "cuda"


def main(argv: list[str] | None = None) -> int:
    """Measure every shape (in-process routes, then fresh processes), print and write ``lock_cost.md``."""
    global DEVICE, ITERS
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=100, help="calls per timed loop")
    ap.add_argument("--shapes", default="", help="only shapes whose name contains this")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    DEVICE, ITERS = ns.device, ns.iters
    lz.configure(use_perfdb=False)
    if ns.child:
        name, route = ns.child.split("|")
        print(json.dumps(measure(name, ns.device, [route], ns.rounds)))
        return 0
    rows = []
    for name in [n for n in SHAPES if ns.shapes in n]:
        res = measure(name, ns.device, ["default", "lock", "prefer"], ns.rounds)
        for route in ("default", "lock"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--device",
                    ns.device,
                    "--rounds",
                    str(ns.rounds),
                    "--iters",
                    str(ns.iters),
                    "--child",
                    f"{name}|{route}",
                ],
                capture_output=True,
                text=True,
                env=os.environ,
            )
            fresh = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
            res[f"fresh {route}"] = fresh.get(route, float("nan"))
        rows.append((name, res))
        print(name, res, flush=True)
    lines = [
        "# Per-call cost by route: default vs lz.lock vs lz.prefer of the same kernel",
        "",
        f"- device: {torch.cuda.get_device_name() if ns.device == 'cuda' else 'cpu'}; torch "
        f"{torch.__version__}",
        "- µs per call (wall, synchronized loop of 100 calls; median of rounds); fresh = a new process",
        "",
        "| shape | kernel | default | lock | prefer | fresh default | fresh lock | FlashInfer plans |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['kernel']} | {r['default']:.1f} | {r['lock']:.1f} | {r['prefer']:.1f} | "
            f"{r['fresh default']:.1f} | {r['fresh lock']:.1f} | {r['plans']} |"
        )
    text = "\n".join(lines)
    print(text)
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "lock_cost.md").write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
