"""Host cost per call of the eager paged-decode paths on a CUDA GPU: where the microseconds of a launch-bound
kernel go (``triton.paged_decode`` read 70 µs on one H200 host and 104-127 µs on another for the same small
shapes, FlashInfer 36-62 µs; the shipped defaults were measured on the first).

Each row times ``--calls`` back-to-back calls with ``time.perf_counter`` and no synchronization inside the
loop, on a shape whose GPU work is a few µs, so the queue never fills and the time is the host's: Python,
argument binding, the launch itself. Rows: ``torch.empty`` of the workspace; one raw Triton launch of the
split kernel with prepared arguments; ``triton.paged_decode`` called directly (two launches + its Python);
``lz.paged_attention`` locked to each paged kernel (LayerZero's dispatch on top); and for scale a plain
``torch.add``.

Usage: ``PYTHONPATH=src python benchmarks/bench_launch.py --out /tmp/launch.md`` (CUDA only).
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

import torch

import layerzero as lz


def host_us(fn, calls: int) -> float:
    """Median over 5 rounds of the host time per call (µs) of ``calls`` unsynchronized calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from layerzero.backends.triton import paged as tp

    dev = torch.device("cuda")
    b, hq, hkv, d, page = 2, 32, 8, 128, 16
    blocks = 8  # 128 tokens per sequence: a few µs of GPU work
    cache = lz.allocate_kv_cache(b * blocks + 1, page, hkv, d, torch.bfloat16, "NHD", dev)
    cache.normal_()
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    table = torch.arange(b * blocks, dtype=torch.int32, device=dev).view(b, blocks)
    lens = torch.full((b,), blocks * page, dtype=torch.int32, device=dev)
    kern = tp._KERNELS.get()
    bn = tp.block_n_for(d)
    split_len, splits = tp.choose_split_len(b, hkv, blocks * page, tp.sm_count(dev), bn)
    rows = b * hq * splits
    ws = torch.empty(rows * (d + 1), dtype=torch.float32, device=dev)
    ws_out, ws_lse = ws[: rows * d].view(b, hq, splits, d), ws[rows * d :].view(b, hq, splits)
    st = cache.stride()
    group = hq // hkv

    # the split kernel's arguments (two-kernel form: lse_out, o and cnt unused there, scales 1.0)
    split_args = (
        q,
        cache,
        table,
        lens,
        ws_out,
        ws_lse,
        ws_lse,
        q,
        q,
        0.1,
        1.0,
        1.0,
        q.stride(0),
        q.stride(1),
        st[0],
        st[1],
        st[2],
        st[3],
        table.stride(0),
        split_len,
        page,
        group,
        splits,
        *ws_out.stride()[:3],
        hq * splits,
    )
    split_kw = dict(
        GROUP_PAD=16,
        HEAD_DIM=d,
        D_PAD=d,
        BLOCK_N=bn,
        INTERPRET=False,
        TILES_PER_SPLIT=0,
        UPCAST=False,
        DIRECT=False,
        num_warps=4,
    )
    grid = (b, hkv, splits)

    def raw_split():
        kern.paged_decode_split[grid](*split_args, **split_kw)

    from layerzero.backends.triton._launch import FastLaunch

    fast = FastLaunch(kern.paged_decode_split)

    def fast_split():
        fast(grid, *split_args, **split_kw)

    def pinned_split():
        fast.pinned("bench", grid, *split_args, **split_kw)

    pinned_split()
    binder = kern.paged_decode_split.device_caches[torch.cuda.current_device()][4]
    compiled, tail = next(iter(fast.pins.values()))
    stream = torch.cuda.current_stream().cuda_stream

    def run_only():
        compiled.run(
            *grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *split_args, *tail
        )

    x = torch.randn(16, device=dev)
    rows_out = [
        ("torch.add (scale)", host_us(lambda: x + x, a.calls)),
        (
            "torch.empty workspace",
            host_us(lambda: torch.empty(rows * (d + 1), dtype=torch.float32, device=dev), a.calls),
        ),
        (f"raw Triton launch, split kernel ({splits} splits)", host_us(raw_split, a.calls)),
        ("FastLaunch of the same kernel (backends/triton/_launch.py)", host_us(fast_split, a.calls)),
        ("FastLaunch.pinned of the same kernel (no binder on a hit)", host_us(pinned_split, a.calls)),
        ("  of which Triton's binder alone", host_us(lambda: binder(*split_args, **split_kw), a.calls)),
        ("  of which the compiled kernel's launcher alone", host_us(run_only, a.calls)),
        (
            f"triton.paged_decode direct ({1 + (splits > 1)} launches)",
            host_us(lambda: tp.paged_decode(q, cache, table, lens), a.calls),
        ),
    ]
    for kid in ("triton.paged_decode", "flashinfer.paged_attention", "torch_sdpa.paged_attention"):
        try:
            lz.lock("paged_attention", kid)
            lz.paged_attention(q, cache, table, lens)
            rows_out.append(
                (
                    f"lz.paged_attention locked to {kid}",
                    host_us(lambda: lz.paged_attention(q, cache, table, lens), a.calls),
                )
            )
        except lz.LayerZeroError as exc:
            rows_out.append((f"lz.paged_attention locked to {kid}", math.nan))
            print(f"{kid}: {exc}")
        finally:
            lz.unlock("paged_attention")
    props = torch.cuda.get_device_properties(dev)
    cpu = (
        next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            platform.machine(),
        )
        if Path("/proc/cpuinfo").exists()
        else "?"
    )
    lines = [
        f"# Host cost per call, {props.name}, torch {torch.__version__}, host CPU {cpu}",
        "",
        f"B{b} Hq{hq}/Hkv{hkv} D{d} bf16, {blocks * page} tokens per sequence; {a.calls} unsynchronized "
        "calls per round, median of 5 rounds.",
        "",
        "| path | host µs per call |",
        "| --- | ---: |",
    ]
    lines += [f"| {name} | {us:.1f} |" for name, us in rows_out]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
