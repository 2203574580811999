"""The NCCL / symmetric-memory scenario of tests/gpu/test_gpu_collectives.py (run by hand on 2+ GPUs; spawned
by ``_coll_harness.spawn(..., backend="nccl")``): the oracle checks of every op on CUDA, symm_mem one-shot and
two-shot against NCCL and the float64 oracle, the choice by message size, and CUDA-graph capture / replay."""

from __future__ import annotations

import os
from typing import Any

import torch
from _coll_harness import _check_all, _err, inputs

MiB = 1 << 20
SYMM = ("symm_mem.one_shot", "symm_mem.two_shot", "symm_mem.one_shot_push")
RACE_SIZES = (4096, 3, 250_001, 4096 * 24, 1, 524_288)  # bf16 elements: chunk counts 1, 1, 62, 24, 1, 128


def _push_race(rank: int, world: int, dev: str) -> dict[str, Any]:
    """``symm_mem.one_shot_push`` called back to back with changing sizes (so the programs' call counters
    drift apart), eagerly and as 20 rounds captured in one CUDA graph replayed 3 times with new inputs: every
    result against the float64 sum, and a checksum of the bits that must equal every other rank's."""
    import torch.distributed as dist

    import layerzero as lz

    xs = [inputs(rank, (n,), torch.bfloat16, n).to(dev) for n in RACE_SIZES]
    wants = [_oracle(world, n, n) for n in RACE_SIZES]  # float64 on the CPU (_err moves the result)
    worst, bits = 0.0, torch.zeros((), dtype=torch.float64, device=dev)
    lz.lock("all_reduce", "symm_mem.one_shot_push")
    try:
        for _ in range(5):
            for x, want in zip(xs, wants, strict=True):
                worst = max(worst, _err(lz.all_reduce(x), want))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs = [lz.all_reduce(x) for x in xs]
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                outs = [lz.all_reduce(x) for x in xs]
        for k in range(1, 4):
            for x, n in zip(xs, RACE_SIZES, strict=True):
                x.copy_(inputs(rank, (n,), torch.bfloat16, n) * k)
            g.replay()
            torch.cuda.synchronize()
            for out, want in zip(outs, wants, strict=True):
                worst = max(worst, _err(out, want * k) / k)
                bits += out.view(torch.int16).double().sum()
    finally:
        lz.unlock("all_reduce")
    every = [None] * world
    dist.all_gather_object(every, float(bits), group=None)
    return {"err": worst, "same_bits": len(set(every)) == 1}


def _oracle(world: int, n: int, tag: int) -> torch.Tensor:
    return sum(inputs(r, (n,), torch.float64, tag) for r in range(world))


def _capture(fn, x: torch.Tensor) -> tuple[float, float]:
    """Eager run, side-stream warm-up, capture, replay with new data: (eager vs replay, replay vs eager of
    the new data) max abs differences."""
    eager = fn(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x)
    torch.cuda.current_stream().wait_stream(s)
    static_in = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = fn(static_in)
    g.replay()
    torch.cuda.synchronize()
    first = float((static_out.float() - eager.float()).abs().max())
    static_in.mul_(2)
    g.replay()
    torch.cuda.synchronize()
    second = float((static_out.float() - 2 * eager.float()).abs().max())
    return first, second


def gpu_scenario(rank: int, world: int, res: dict[str, Any]) -> None:
    import layerzero as lz

    dev = f"cuda:{rank}"
    check: dict[str, Any] = {}
    _check_all(world, rank, check, device=dev)
    res["nccl_bad"] = check["bad"]
    buf = lz.distributed.enable_symm_mem(max_bytes=8 * MiB)
    res["p2p"], res["why_not"] = buf.p2p, buf.why_not
    res["multicast_env"] = os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")
    res["which"], res["err"], res["vs_nccl"] = {}, {}, {}
    for n in (1000, 64 * 1024, 1024 * 1024, 8 * MiB):  # bf16: 2 KB, 128 KiB, 2 MiB, 16 MiB
        x = inputs(rank, (n,), torch.bfloat16, n).to(dev)
        want = _oracle(world, n, n)
        res["which"][str(n)] = lz.which("all_reduce", x)
        nccl = None
        for k in ("torch_dist.all_reduce", *SYMM):
            lz.lock("all_reduce", k)
            try:
                out = lz.all_reduce(x)
            except lz.LayerZeroError as exc:  # the lock refused these inputs (message too large)
                res["err"][f"{k}/{n}"] = type(exc).__name__
                continue
            finally:
                lz.unlock("all_reduce")
            res["err"][f"{k}/{n}"] = _err(out, want)
            if k.startswith("torch_dist"):
                nccl = out
            else:
                res["vs_nccl"][f"{k}/{n}"] = float((out.float() - nccl.float()).abs().max())
    res["graph"] = {}
    x = inputs(rank, (4096,), torch.bfloat16, 5).to(dev)
    for k in ("torch_dist.all_reduce", *SYMM):
        lz.lock("all_reduce", k)
        try:
            res["graph"][k] = _capture(lz.all_reduce, x)
        finally:
            lz.unlock("all_reduce")
    res["push_race"] = _push_race(rank, world, dev)
    lz.distributed.disable_symm_mem()
    res["which_after_disable"] = lz.which("all_reduce", x)
