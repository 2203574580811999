"""A tensor-parallel rank other than 0 (:mod:`.multiproc`): the spawned worker process's entry point, the
rank's life (join the group, connect to rank 0, build its :class:`~layerzero.engine.worker.worker.Worker`,
serve what rank 0 sends) and the helpers both sides share (a rank's device, rank 0's address broadcast)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist

import layerzero as lz

from ..config import EngineConfig, ModelConfig
from ..parallel.launch import enable_symm_all_reduce, init_distributed, leave_group
from ..parallel.state import ParallelState
from ..worker.sampler import SamplingError
from ..worker.worker import ModelRunnerOutput, Worker
from .channel import Channel, connect, pack, unpack
from .step_codec import StepDecoder

__all__ = ["broadcast_address", "rank_device", "run_rank", "worker_main"]

_ADDR_BYTES = 256


def broadcast_address(parallel: ParallelState, device: torch.device, value: list[Any] | None) -> list[Any]:
    """Rank 0's ``value`` (host, port, key) on every rank: one fixed-size broadcast of its msgpack bytes."""
    buf = torch.zeros(_ADDR_BYTES, dtype=torch.uint8, device=device)
    if value is not None:
        data = pack(value)
        buf[0] = len(data)
        buf[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=parallel.group)
    raw = bytes(buf.cpu().tolist())
    return unpack(raw[1 : 1 + raw[0]])


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent exits (no orphan worker if the engine is killed)."""
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main(
    rank: int,
    world: int,
    addr: str,
    port: int,
    ec_bytes: bytes,
    dtype: torch.dtype,
    max_model_len: int,
    budget: int,
) -> None:
    """A spawned worker process: rank ``rank`` (its local rank too) of ``world``."""
    _die_with_parent()
    from ..config import resolve_device
    from ..core.serial import decode_config

    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    ec = decode_config(ec_bytes)
    device = rank_device(resolve_device(ec.device), rank)
    if device.type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    raise SystemExit(run_rank(rank, world, device, ec, dtype, max_model_len, budget))


def run_rank(
    rank: int,
    world: int,
    device: torch.device,
    ec: EngineConfig,
    dtype: torch.dtype,
    max_model_len: int,
    budget: int,
) -> int:
    """Rank ``rank`` >= 1: join the group, connect to rank 0, build the worker, run what rank 0 sends until it
    says shutdown (or goes away). Returns the exit code (0: shut down; 1: failed, reported to rank 0)."""
    parallel = dataclasses.replace(init_distributed(rank, world, device), ep=ec.enable_expert_parallel)
    chan: Channel | None = None
    try:
        host, port, key = broadcast_address(parallel, device, None)
        chan = connect(host, port, key, rank, 60.0)
        enable_symm_all_reduce(parallel, device)
        lz.distributed.sync_selection(device=device)
        cfg = ModelConfig.from_pretrained(ec.model)
        worker = Worker(cfg, ec, device, dtype, max_model_len, budget, parallel)
        chan.send(["ready", rank])
        _profiled(rank, lambda: _serve(worker, chan))
        return 0
    except EOFError:  # rank 0 went away: nothing to report to
        return 1
    except BaseException as exc:
        if chan is not None:
            with contextlib.suppress(Exception):
                chan.send(["failed", rank, type(exc).__name__, str(exc), traceback.format_exc()])
        else:
            traceback.print_exc()
        return 1
    finally:
        if chan is not None:
            chan.close()
        leave_group()


def _profiled(rank: int, serve: Any) -> None:
    """Run ``serve()``; with ``LAYERZERO_WORKER_PROFILE=PREFIX`` in the environment, under cProfile, its
    stats written to ``PREFIX.rank<N>.txt`` (top functions by own time) when it returns (a debugging aid:
    benchmarks/parallel/tp_batch1.py reads the workers' host cost per step from it)."""
    prefix = os.environ.get("LAYERZERO_WORKER_PROFILE")
    if not prefix:
        serve()
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        prof.runcall(serve)
    finally:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
        with open(f"{prefix}.rank{rank}.txt", "w") as f:
            f.write(s.getvalue())


def _serve(worker: Worker, chan: Channel) -> None:
    """The worker loop: each step as rank 0 runs it; a launched step's tokens are read after the next one is
    launched (as rank 0 does with async scheduling), so the device never idles on this rank's host."""
    pending: ModelRunnerOutput | None = None
    decoder = StepDecoder()
    while True:
        msg = chan.recv()
        kind = msg[0]
        if kind == "step":
            out = decoder.decode(msg)
            try:
                launched = worker.execute_model(out)
            except SamplingError:  # rank 0 raised the same: the core rolls back and sends reset
                launched = None
            if pending is not None:
                pending.get_output()
            pending = launched
        elif kind == "reset":
            pending = None
            worker.reset()
        elif kind == "report":
            worker.runner.kernel_report([(k, int(n)) for k, n in msg[1]])
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"executor channel: expected step, reset, report or shutdown, got {kind!r}")


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the rank ``local_rank`` of its node: ``cuda:<local_rank>`` on CUDA, else ``device``."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device
