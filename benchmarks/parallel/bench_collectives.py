"""``lz.all_reduce``'s kernels and ``lz.all_gather`` timed on N GPUs of one host, eager and inside a CUDA
graph, per message size (bf16), next to the kernel LayerZero chooses for that size: the numbers behind the
selection of issue 38 ("a decode step's small all-reduce chosen by LayerZero <= 6 µs in a graph").

Each rank runs the same calls; a timed loop starts after a barrier; the reported time is rank 0's CUDA-event
time per call (eager: ``iters`` calls back to back; graph: ``calls`` calls captured in one graph, replayed
``replays`` times). NVLink multicast stays off (the engine's ``COMM_ENV``).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=src python benchmarks/parallel/bench_collectives.py --world 2 --out DIR

Writes ``DIR/collectives.json`` and ``DIR/collectives.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

KERNELS = ("torch_dist.all_reduce", "symm_mem.one_shot", "symm_mem.two_shot", "symm_mem.one_shot_push")
SIZES = tuple(1 << k for k in range(10, 26))  # bytes of one rank's message: 1 KiB .. 32 MiB


def _events_us(fn: Any, n: int) -> float:
    """Mean µs per call of ``n`` back-to-back ``fn()`` calls on the current stream (CUDA events)."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def _graph_us(fn: Any, calls: int, replays: int) -> float:
    """µs per call of ``fn`` captured ``calls`` times in one CUDA graph (warmed on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    return _events_us(g.replay, replays) / calls


def _rank(rank: int, world: int, port: int, out: str, iters: int) -> None:
    import torch.distributed as dist

    import layerzero as lz
    from layerzero.engine.parallel.launch import SYMM_MEM_BYTES, init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    init_distributed(rank, world, dev)
    buf = lz.distributed.enable_symm_mem(max_bytes=SYMM_MEM_BYTES)
    rows: list[dict[str, Any]] = []
    for nbytes in SIZES:
        x = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
        row: dict[str, Any] = {"bytes": nbytes, "chosen": lz.which("all_reduce", x)}
        for k in KERNELS:
            lz.lock("all_reduce", k)
            try:
                lz.all_reduce(x)
            except lz.LayerZeroError as exc:
                row[k] = {"refused": type(exc).__name__}
                continue
            finally:
                lz.unlock("all_reduce")
            lz.lock("all_reduce", k)
            try:
                row[k] = {
                    "eager_us": _events_us(functools.partial(lz.all_reduce, x), iters),
                    "graph_us": _graph_us(functools.partial(lz.all_reduce, x), 32, max(4, iters // 32)),
                }
            finally:
                lz.unlock("all_reduce")
        row["chosen_graph_us"] = _graph_us(functools.partial(lz.all_reduce, x), 32, max(4, iters // 32))
        # the logits all-gather of a TP decode step has (rows x vocab / world) floats per rank
        g = torch.randn(nbytes // 4, device=dev, dtype=torch.float32)
        row["all_gather"] = {
            "kernel": lz.which("all_gather", g),
            "eager_us": _events_us(functools.partial(lz.all_gather, g), iters),
            "graph_us": _graph_us(functools.partial(lz.all_gather, g), 32, max(4, iters // 32)),
        }
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "world": world,
            "gpu": torch.cuda.get_device_name(dev),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "host": platform.node(),
            "p2p": buf.p2p,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
        }
        Path(out, "collectives.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        Path(out, "collectives.md").write_text(_table(meta, rows))
    lz.distributed.disable_symm_mem()
    dist.destroy_process_group()


def _cell(r: dict[str, Any], k: str, key: str) -> str:
    v = r.get(k, {})
    return f"{v[key]:.1f}" if key in v else "-"


def _table(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# Collectives on {meta['world']} x {meta['gpu']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, CUDA {meta['cuda']}, NCCL {meta['nccl']}, peer access {meta['p2p']}, "
        f"env {meta['env']}. µs per call (rank 0's CUDA events; graph: 32 calls in one graph). bf16 "
        "all-reduce of `bytes` per rank; all-gather of `bytes` of float32 per rank.",
        "",
        "| bytes | chosen | chosen, graph | NCCL eager | NCCL graph | one-shot eager | one-shot graph "
        "| two-shot eager | two-shot graph | push eager | push graph | all_gather graph |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        cells = " | ".join(f"{_cell(r, k, 'eager_us')} | {_cell(r, k, 'graph_us')}" for k in KERNELS)
        lines.append(
            f"| {r['bytes']} | {r['chosen']} | {r['chosen_graph_us']:.1f} | {cells} | "
            f"{r['all_gather']['graph_us']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from layerzero.engine.parallel.launch import free_port, set_comm_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    set_comm_env()
    mp.spawn(_rank, args=(a.world, free_port(), str(a.out), a.iters), nprocs=a.world, join=True)
    print((a.out / "collectives.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
