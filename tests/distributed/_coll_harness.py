"""Multi-process harness of the collective-op tests (CPU/Gloo): :func:`spawn` starts ``world`` ranks, each
runs :func:`scenario` and writes a JSON result; the parent reads them back. A worker's exception fails the
parent with its traceback; a hang is killed after ``limit_s`` (every process started here is ended here).

Every rank regenerates every rank's seeded inputs (:func:`inputs`), so each computes the float64
single-process oracle of its own expected output and compares: no tensor crosses the harness.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}
SHAPES = ((5, 123), (3, 7, 11), (1,))


def spawn(world: int, tmp: Path, *, backend: str = "gloo", limit_s: float = 60.0) -> list[dict[str, Any]]:
    """Run :func:`scenario` (Gloo, CPU) or ``_coll_gpu.gpu_scenario`` (NCCL, one GPU a rank) on ``world``
    spawned ranks; their JSON results, in rank order."""
    import torch.multiprocessing as mp

    out = tmp / "ranks"
    out.mkdir()
    ctx = mp.spawn(_entry, args=(world, str(tmp / "init"), str(out), backend), nprocs=world, join=False)
    deadline = time.monotonic() + limit_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise AssertionError(f"collectives on {world} ranks did not finish in {limit_s:.0f} s (hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def _entry(rank: int, world: int, init: str, out: str, backend: str) -> None:
    import torch.distributed as dist

    import layerzero as lz

    torch.set_num_threads(1)
    os.environ.pop("TORCH_SYMM_MEM_DISABLE_MULTICAST", None)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    lz.configure(perfdb_path=os.path.join(out, f"perfdb{rank}.sqlite"))
    result: dict[str, Any] = {"rank": rank}
    try:
        if backend == "nccl":
            from _coll_gpu import gpu_scenario

            gpu_scenario(rank, world, result)
        else:
            scenario(rank, world, result)
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(result, default=str))
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- inputs, oracles
def inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> torch.Tensor:
    """Rank ``rank``'s seeded input (any rank can regenerate any other's)."""
    g = torch.Generator().manual_seed(1000 * tag + 17 * rank + len(shape))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.cpu()
    if got.shape != want.shape:
        return float("inf")
    return float(((got.double() - want) / (1 + want.abs())).abs().max()) if want.numel() else 0.0


def _check_all(world: int, rank: int, res: dict[str, Any], device: str = "cpu") -> None:
    """Every op, shape and dtype, against the float64 oracle (inputs moved to ``device``)."""
    import layerzero as lz

    errs: dict[str, float] = {}
    tag = 0
    for dtype in DTYPES:
        for shape in (*SHAPES, ()):
            tag += 1
            xs = [inputs(r, shape, dtype, tag) for r in range(world)]
            ref = [x.double() for x in xs]
            x = xs[rank].to(device)
            before = x.clone()
            for op in ("sum", "avg", "max"):
                want = {
                    "sum": sum(ref),
                    "avg": sum(ref) / world,
                    "max": torch.stack(ref).amax(0),
                }[op]
                errs[f"all_reduce/{op}/{dtype}/{shape}"] = _err(lz.all_reduce(x, op=op), want)
            res.setdefault("unchanged", []).append(bool(torch.equal(x, before)))
            if not shape:
                continue
            for dim in range(-1, len(shape)):
                errs[f"all_gather/{dim}/{dtype}/{shape}"] = _err(
                    lz.all_gather(x, dim=dim), torch.cat(ref, dim)
                )
            # reduce_scatter: dim 0 and the last dim scaled by the world size
            for dim in (0, len(shape) - 1):
                big = list(shape)
                big[dim] *= world
                ys = [inputs(r, tuple(big), dtype, tag + 500) for r in range(world)]
                want = sum(y.double() for y in ys).chunk(world, dim)[rank]
                errs[f"reduce_scatter/{dim}/{dtype}/{shape}"] = _err(
                    lz.reduce_scatter(ys[rank].to(device), dim=dim), want
                )
            # all_to_all: equal splits, then uneven (rank s sends s + d + 1 rows to rank d)
            rows = [inputs(r, (world * 2, *shape[1:]), dtype, tag + 900) for r in range(world)]
            want = torch.cat([rows[s].double()[2 * rank : 2 * rank + 2] for s in range(world)])
            errs[f"all_to_all/even/{dtype}/{shape}"] = _err(lz.all_to_all(rows[rank].to(device)), want)
            sizes = [[s + d + 1 for d in range(world)] for s in range(world)]
            un = [inputs(s, (sum(sizes[s]), *shape[1:]), dtype, tag + 700) for s in range(world)]
            parts = [un[s].double().split(sizes[s], 0)[rank] for s in range(world)]
            got = lz.all_to_all(un[rank].to(device), [sizes[s][rank] for s in range(world)], sizes[rank])
            errs[f"all_to_all/uneven/{dtype}/{shape}"] = _err(got, torch.cat(parts))
        # a non-contiguous input is copied, not refused
        t = inputs(rank, (6, 4), dtype, 77).to(device).t()
        want_t = sum(inputs(r, (6, 4), dtype, 77).double() for r in range(world)).t()
        errs[f"all_reduce/noncontig/{dtype}"] = _err(lz.all_reduce(t), want_t)
        errs[f"all_gather/noncontig/{dtype}"] = _err(
            lz.all_gather(t, dim=1),
            torch.cat([inputs(r, (6, 4), dtype, 77).double().t() for r in range(world)], 1),
        )
    res["bad"] = {k: v for k, v in errs.items() if v > TOL[_dtype_of(k)]}
    res["n_checked"] = len(errs)


def _dtype_of(name: str) -> torch.dtype:
    for d in DTYPES:
        if str(d) in name:
            return d
    raise KeyError(name)


def _error(fn) -> dict[str, Any]:
    from layerzero import LayerZeroError

    try:
        fn()
    except LayerZeroError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def scenario(rank: int, world: int, res: dict[str, Any]) -> None:
    """Oracle checks through the chosen kernels, then through the locked reference kernels; the selection on
    CPU (kernels, symm_mem reasons, context); the typed errors (raised before any communication, on every rank
    alike, so the group stays in step)."""
    import layerzero as lz

    x = torch.randn(5, 6)
    res["which"] = {
        "all_reduce": lz.which("all_reduce", x),
        "all_gather": lz.which("all_gather", x),
        "reduce_scatter": lz.which("reduce_scatter", torch.randn(world * 2, 3)),
        "all_to_all": lz.which("all_to_all", torch.randn(world, 3)),
    }
    _check_all(world, rank, res)
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    for op in ops:
        lz.lock(op, f"reference.{op}")
    ref_res: dict[str, Any] = {}
    _check_all(world, rank, ref_res)
    res["ref_bad"], res["ref_which"] = ref_res["bad"], lz.which("all_reduce", x)
    for op in ops:
        lz.unlock(op)
    rep = lz.explain("all_reduce", x)
    res["chosen"] = rep.chosen
    res["ctx"] = {
        k: v for k, v in rep.context.fields().items() if k in ("world_size", "message_bytes", "comm_backend")
    }
    res["rejected"] = {
        c.kernel_id: [[r.code.value, r.message] for r in c.reasons] for c in rep.candidates if c.reasons
    }
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    lz.explain("all_reduce", x)  # not cached: a fresh report
    rep1 = lz.explain("all_reduce", x)
    res["codes_multicast_off"] = sorted(
        r.code.value for c in rep1.candidates if c.kernel_id == "symm_mem.one_shot" for r in c.reasons
    )
    res["errors"] = {
        "rs_indivisible": _error(lambda: lz.reduce_scatter(torch.randn(world * 2 + 1, 3))),
        "a2a_len": _error(lambda: lz.all_to_all(torch.randn(world, 2), input_split_sizes=[1] * (world + 1))),
        "a2a_sum": _error(lambda: lz.all_to_all(torch.randn(world, 2), [1] * world, [2] * world)),
        "a2a_neg": _error(lambda: lz.all_to_all(torch.randn(world, 2), [1] * world, [-1] + [1] * world)),
        "a2a_out_missing": _error(lambda: lz.all_to_all(torch.randn(world + 1, 2), None, [1] * world + [1])),
        "dtype": _error(lambda: lz.all_reduce(torch.ones(3, dtype=torch.bool))),
        "dim": _error(lambda: lz.all_gather(torch.ones(3), dim=1)),
        "avg_int": _error(lambda: lz.all_reduce(torch.ones(3, dtype=torch.int64), op="avg")),
        "op": _error(lambda: lz.all_reduce(torch.ones(3), op="mean")),
        "symm_gloo": _error(lz.distributed.enable_symm_mem),
    }
    # integers reduce exactly (after the errors: every rank is still in step)
    res["int_sum"] = lz.all_reduce(torch.full((3,), rank + 1, dtype=torch.int64)).tolist()
