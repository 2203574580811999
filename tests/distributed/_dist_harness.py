"""Multi-process harness of the synchronized-selection tests (CPU/Gloo here, CUDA/NCCL in tests/gpu).

:func:`spawn` starts ``world`` processes with ``torch.multiprocessing`` (spawn), each runs one scenario of
:data:`SCENARIOS` under ``init_process_group(backend, init_method=file://...)`` and writes a JSON result per
rank; the parent reads them back. A worker's exception fails the parent with its traceback; a hang is killed
after ``limit_s`` and fails the test.

Ranks are made to differ on purpose (:func:`make_ranks_differ`): rank 1 has ``lz.lock``s, rank 2 a policy file
with ``deny`` rules, rank 3 a lower (fake) free memory and PerfDB measurements preferring other kernels; every
rank registers the same custom rms_norm kernel with a declared workspace, which only rank 3's memory rejects.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

WS_KERNEL = "distlab.ws_rms"
"""A custom rms_norm kernel (priority 70 > torch_native's 50) declaring a 16 MiB workspace."""
STRICT_KERNEL = "distlab.rms_hi"
"""A custom rms_norm kernel (priority 99) registered mid-test; the last rank's copy accepts float64 only."""
MiB = 1 << 20


def spawn(
    scenario: str,
    world: int,
    tmp: Path,
    *,
    backend: str = "gloo",
    pg_timeout_s: float = 60.0,
    limit_s: float = 90.0,
) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` spawned ranks; their JSON results, in rank order."""
    import torch.multiprocessing as mp

    out = tmp / "ranks"
    out.mkdir()
    ctx = mp.spawn(
        _entry,
        args=(world, str(tmp / "init"), str(out), scenario, backend, pg_timeout_s),
        nprocs=world,
        join=False,
    )
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise AssertionError(
                f"scenario {scenario!r} on {world} ranks did not finish in {limit_s:.0f} s (hang)"
            )
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def _entry(
    rank: int, world: int, init: str, out: str, scenario: str, backend: str, pg_timeout_s: float
) -> None:
    import torch.distributed as dist

    import layerzero as lz

    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(
        backend,
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    lz.configure(perfdb_path=os.path.join(out, f"perfdb{rank}.sqlite"))
    result: dict[str, Any] = {"rank": rank}
    try:
        SCENARIOS[scenario](rank, world, device, Path(out), result)
    finally:
        lz.distributed.unsync()
        Path(out, f"{rank}.json").write_text(json.dumps(result, default=str))
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- inputs and oracles
def cases(device: str) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """The calls every rank makes (same seed on every rank): rms_norm and attention at several shapes."""
    g = torch.Generator().manual_seed(1234)
    half = torch.float16 if device.startswith("cuda") else torch.float32
    out: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    for shape in ((2, 8, 64), (3, 5, 96), (1, 16, 128)):
        x = torch.randn(*shape, generator=g).to(device)
        w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device)
        out.append(("rms_norm", (x, w), {"eps": 1e-6}))
    for (b, h, s, d), causal in (((1, 4, 16, 32), True), ((2, 2, 7, 64), False), ((1, 8, 33, 64), True)):
        q, k, v = (torch.randn(b, h, s, d, generator=g).to(device, half) for _ in range(3))
        out.append(("attention", (q, k, v), {"is_causal": causal}))
    return out


def reference(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The float64 oracle of one case."""
    if op == "rms_norm":
        x, w = (t.double() for t in args)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + kwargs["eps"]) * w
    q, k, v = (t.double() for t in args)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if kwargs["is_causal"]:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def run_case(case: tuple[str, tuple[Any, ...], dict[str, Any]]) -> torch.Tensor:
    import layerzero as lz

    op, args, kwargs = case
    return getattr(lz, op)(*args, **kwargs)


def which(case: tuple[str, tuple[Any, ...], dict[str, Any]]) -> str:
    import layerzero as lz

    op, args, kwargs = case
    return lz.which(op, *args, **kwargs)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- checks
def check_main(results: list[dict], world: int) -> None:
    """The checks of :func:`scenario_main`'s results on ``world`` ranks (shared with the NCCL test)."""
    r0 = results[0]
    assert [r["rank_world"] for r in results] == [[r, world] for r in range(world)]
    # Without sync the ranks choose differently (so the checks below can fail).
    for r in results[1:]:
        assert all(a != b for a, b in zip(r["before"], r0["before"], strict=True)), (
            r["rank"],
            r["before"],
            r0["before"],
        )
    assert r0["before"][0] == WS_KERNEL
    # After sync every rank runs rank 0's kernels, and its outputs are bit-identical to rank 0's.
    for r in results:
        assert r["after"] == r0["before"], (r["rank"], r["after"])
        assert r["digests"] == r0["digests"], r["rank"]
        assert max(r["max_err"]) <= r["tol"], (r["rank"], r["max_err"])
        # the same decisions on every rank; on CUDA the first eager call of a key also decides its
        # capture-time key (collectively), so there are more decisions than eager calls there (seen on 2 H200s
        # over NCCL)
        assert r["decisions"] == r0["decisions"] and r["n_decisions"] == r0["n_decisions"]
        assert set(r0["before"]) <= set(r["decisions"])
        assert r["n_decisions"] == len(r0["before"]) or r.get("cuda")
        assert r["explain_chosen"] == r0["before"][0]
        assert any("rank 0's choice" in n for n in r["explain_notes"]), r["explain_notes"]
        assert any("rank 0's choice" in n for n in r["explain_attention_notes"])
        assert any("have not been called yet" in n for n in r["explain_new_notes"])
        # A rank-local invalidation re-used the kept decisions: no new decision, same kernels and outputs.
        assert r["again"] == r0["before"] and r["again_digests"] == r0["digests"]
        assert r["again_new_decisions"] == 0
        assert set(r["traced"]) == set(r0["before"])
        if "graph_ok" in r:
            assert r["graph_ok"], r["rank"]
    for r in results[1:]:
        assert any(
            f"rank {r['rank']} alone would have chosen {r['before'][0]}" in n for n in r["explain_notes"]
        )
    # A call that differs between ranks: the same typed error on every rank, naming rank 1 and the field.
    for r in results:
        m = r["mismatch"]
        assert (m["type"], m["rank"], m["field"], m["expected"], m["got"]) == (
            "DistributedMismatchError",
            1,
            "hidden_size",
            200,
            208,
        ), m
    # Rank 0's kernel cannot run the last rank's inputs: every rank raises, naming that rank and the reason.
    for r in results:
        c = r["cannot_run"]
        assert (c["type"], c["rank"]) == ("DistributedSelectionError", world - 1), c
        assert STRICT_KERNEL in c["message"] and "DTYPE_UNSUPPORTED" in c["message"]
    # unsync: back to each rank's own view.
    for r in results:
        assert r["unsynced"] == r["before"], r["rank"]
    # A backend version that differs on the last rank is refused at sync time, on every rank alike.
    for r in results:
        v = r["version_mismatch"]
        assert (v["type"], v["rank"], v["field"], v["got"]) == (
            "DistributedMismatchError",
            world - 1,
            "backend torch_sdpa version",
            "0.0.0+fake",
        ), v
        assert v["expected"] not in (None, "0.0.0+fake")
        assert f"rank {world - 1}" in v["message"]
        assert r["synced_after_refusal"] is False


# ------------------------------------------------------------------------------------------- rank differences
def _ws_rms(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Any = None) -> Any:
    if residual is not None:
        x = x + residual
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return y if residual is None else (y, x)


def make_ranks_differ(rank: int, device: str, out: Path) -> None:
    """Give each rank its own local view (see the module docstring)."""
    import layerzero as lz
    from layerzero.core.runtime import RUNTIME

    lz.register_kernel(
        "rms_norm",
        WS_KERNEL,
        _ws_rms,
        priority=70,
        device_types={"cpu", "cuda"},
        dtypes={"float32", "float16", "bfloat16"},
        workspace=lambda ctx: 16 * MiB,
    )
    RUNTIME.free_memory = (lambda _dev: 1 * MiB) if rank == 3 else (lambda _dev: 1 << 30)
    if rank == 1:
        lz.lock("rms_norm", "reference.rms_norm")
        lz.lock("attention", "torch_sdpa.math")
    elif rank == 2:
        path = out / "rank2_policy.yaml"
        path.write_text(
            "version: 1\ndeny:\n  - op: rms_norm\n    kernels: [distlab.ws_rms]\n"
            "  - op: attention\n    kernels: [torch_sdpa.flash, torch_sdpa.efficient, torch_sdpa.cudnn, "
            "flash_attn*, flashinfer*, xformers*]\n"
        )
        lz.load_config(path)
    elif rank == 3:
        _prefer_math_in_perfdb(device)


def _prefer_math_in_perfdb(device: str) -> None:
    """PerfDB rows that make torch_sdpa.math the fastest attention kernel for every attention case."""
    import layerzero as lz
    from layerzero.core.dispatch import device_fingerprint_parts
    from layerzero.core.perfdb import fingerprint
    from layerzero.core.runtime import RUNTIME

    db = RUNTIME.perfdb()
    for op, args, kwargs in cases(device):
        if op != "attention":
            continue
        ctx = lz.explain(op, *args, **kwargs).context
        fp = fingerprint(device_fingerprint_parts(ctx.device))
        for c in lz.explain(op, *args, **kwargs).candidates:
            if c.status.value != "rejected":
                db.record(
                    c.kernel_id,
                    op,
                    ctx.bucket_key(),
                    fp,
                    [1.0] if c.kernel_id == "torch_sdpa.math" else [500.0],
                )
    RUNTIME.cache.invalidate()


# ---------------------------------------------------------------------------------------------- scenarios
def _error(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "rank": getattr(exc, "rank", None),
        "field": getattr(exc, "field", None),
        "expected": getattr(exc, "expected", None),
        "got": getattr(exc, "got", None),
        "message": str(exc),
    }


def _expect_error(fn: Callable[[], Any]) -> dict[str, Any]:
    from layerzero import LayerZeroError

    try:
        fn()
    except LayerZeroError as exc:
        return _error(exc)
    return {"type": None}


def scenario_main(rank: int, world: int, device: str, out: Path, res: dict[str, Any]) -> None:
    """Before sync (ranks differ) -> sync -> every case (kernels, outputs, explain) -> a rank-local cache
    invalidation (no collective, same kernels) -> a mismatched call (all ranks raise) -> rank 0's kernel not
    runnable on the last rank (all raise) -> unsync (ranks differ again) -> a backend version mismatch at sync
    (all raise)."""
    import layerzero as lz
    from layerzero.core.runtime import RUNTIME

    make_ranks_differ(rank, device, out)
    calls = cases(device)
    res["before"] = [which(c) for c in calls]
    sync = lz.distributed.sync_selection()
    res["rank_world"] = [sync.rank, sync.world_size]
    res["explain_new_notes"] = list(lz.explain(calls[0][0], *calls[0][1], **calls[0][2]).notes)
    outs = [run_case(c) for c in calls]
    res["after"] = [which(c) for c in calls]
    res["digests"] = [digest(o) for o in outs]
    tol = 5e-3 if outs[-1].dtype == torch.float16 else 1e-4
    res["max_err"] = [
        float((o.double() - reference(*c)).abs().max()) for o, c in zip(outs, calls, strict=True)
    ]
    res["tol"] = tol
    res["cuda"] = device.startswith("cuda")
    res["decisions"] = sorted(set(sync.decisions().values()))
    res["n_decisions"] = len(sync.decisions())
    rep = lz.explain(calls[0][0], *calls[0][1], **calls[0][2])
    res["explain_chosen"], res["explain_notes"] = rep.chosen, list(rep.notes)
    res["explain_attention_notes"] = list(lz.explain(calls[-1][0], *calls[-1][1], **calls[-1][2]).notes)
    if device.startswith("cuda"):
        res["graph_ok"] = _capture_replay(calls[-1])
    # A rank-local invalidation: only rank 1 re-misses; the kept decisions answer without any collective.
    if rank == 1:
        RUNTIME.cache.invalidate()
    n_before = len(sync.decisions())
    with lz.trace() as t:
        res["again_digests"] = [digest(run_case(c)) for c in calls]
    res["again"] = [which(c) for c in calls]
    res["again_new_decisions"] = len(sync.decisions()) - n_before
    res["traced"] = sorted({k for (_op, k) in t.counts})
    # SPMD broken: each rank calls rms_norm with another hidden size -> every rank raises the same typed
    # error.
    hidden = 200 + 8 * rank  # no rank may hit a kept key here (hidden sizes of cases(): 64, 96, 128)
    res["mismatch"] = _expect_error(
        lambda: lz.rms_norm(torch.randn(2, hidden, device=device), torch.ones(hidden, device=device))
    )
    # Rank 0's kernel cannot run the last rank's inputs -> every rank raises, naming that rank and the
    # reasons.
    dtypes = {"float64"} if rank == world - 1 else {"float32", "float16", "bfloat16", "float64"}
    lz.register_kernel(
        "rms_norm", STRICT_KERNEL, _ws_rms, priority=99, device_types={"cpu", "cuda"}, dtypes=dtypes
    )
    res["cannot_run"] = _expect_error(
        lambda: lz.rms_norm(torch.randn(3, 24, device=device), torch.ones(24, device=device))
    )
    lz.unregister_kernel(STRICT_KERNEL)
    lz.distributed.unsync()
    res["unsynced"] = [which(c) for c in calls]
    # A backend version that differs on the last rank: sync_selection refuses on every rank.
    if rank == world - 1:
        reg = RUNTIME.registry
        reg.add_backend(replace(reg.backend("torch_sdpa"), version="0.0.0+fake"), replace=True)
    res["version_mismatch"] = _expect_error(lz.distributed.sync_selection)
    res["synced_after_refusal"] = lz.distributed.current() is not None


def _capture_replay(case: tuple[str, tuple[Any, ...], dict[str, Any]]) -> bool:
    """Capture the case in a CUDA graph (no collective may run inside) and check the replay against eager."""
    op, args, kwargs = case
    eager = run_case(case)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_case(case)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run_case(case)
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.allclose(static.float(), eager.float(), atol=1e-3, rtol=1e-3))


def scenario_extra_call(rank: int, world: int, device: str, out: Path, res: dict[str, Any]) -> None:
    """Rank 1 makes a call on new inputs that rank 0 does not make: rank 1 gets a typed error within the
    process group's timeout instead of hanging."""
    import layerzero as lz

    calls = cases(device)
    lz.distributed.sync_selection()
    run_case(calls[0])
    flag = out / "rank1_done"
    if rank == 1:
        t0 = time.monotonic()
        res["extra"] = _expect_error(lambda: run_case(calls[1]))
        res["waited_s"] = time.monotonic() - t0
        flag.write_text("done")
    else:
        deadline = time.monotonic() + 30
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def scenario_out_of_step(rank: int, world: int, device: str, out: Path, res: dict[str, Any]) -> None:
    """Rank 1 selects a new key while rank 0 runs another LayerZero collective (sync_selection again): both
    get a typed error naming the other side, instead of misreading each other's data."""
    import layerzero as lz

    calls = cases(device)
    lz.distributed.sync_selection()
    run_case(calls[0])
    res["error"] = _expect_error(lz.distributed.sync_selection if rank == 0 else lambda: run_case(calls[1]))


SCENARIOS: dict[str, Callable[[int, int, str, Path, dict[str, Any]], None]] = {
    "main": scenario_main,
    "extra_call": scenario_extra_call,
    "out_of_step": scenario_out_of_step,
}
