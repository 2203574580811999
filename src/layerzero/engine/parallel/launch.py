"""Process-group start-up of the engine's ranks (docs/parallel.md, "Processes and launch"): the environment
every rank process sets (:func:`set_comm_env`), ``torch.distributed`` through ``env://``
(:func:`init_distributed`: NCCL on CUDA, Gloo on CPU, a bounded timeout), and the start-up collectives the
engine needs (:func:`all_reduce_min`). The same calls serve ranks the engine spawns and ranks ``torchrun``
started."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket

import torch
import torch.distributed as dist

import layerzero as lz

from .state import ParallelState

__all__ = [
    "COMM_ENV",
    "PROCESS_GROUP_TIMEOUT_S",
    "SYMM_MEM_BYTES",
    "all_reduce_min",
    "enable_symm_all_reduce",
    "free_port",
    "init_distributed",
    "leave_group",
    "set_comm_env",
]

COMM_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every rank process before any communicator exists: no NVLink multicast (NVLS / symmetric-memory
multicast), which the machines the engine runs on do not lend."""
log = logging.getLogger("layerzero.engine")

SYMM_MEM_BYTES = 8 << 20
"""The TP group's symmetric buffer (bytes of one rank's message): all-reduces up to this size may run as
``symm_mem.one_shot`` / ``symm_mem.two_shot`` (NVLink peer-to-peer) instead of NCCL."""
PROCESS_GROUP_TIMEOUT_S = 120.0
"""The process group's timeout: a collective a dead or stuck rank never joins raises after this long instead
of hanging (the executor also watches the worker processes and fails sooner when one exits)."""


def set_comm_env() -> None:
    """Put :data:`COMM_ENV` into ``os.environ`` (values already set by the user are kept)."""
    for k, v in COMM_ENV.items():
        os.environ.setdefault(k, v)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it; a race with other processes is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_distributed(
    rank: int, world_size: int, device: torch.device, timeout_s: float = PROCESS_GROUP_TIMEOUT_S
) -> ParallelState:
    """Join the default process group through ``env://`` (``MASTER_ADDR`` / ``MASTER_PORT`` from the
    environment, as ``torchrun`` sets them or the executor does for the ranks it spawns) and return this
    rank's :class:`ParallelState` (``ep`` False: the caller sets it). NCCL on CUDA (after
    ``torch.cuda.set_device``), Gloo on CPU. A group already initialised (a ``torchrun``
    script that made it) is reused when its rank and size agree.

    Raises:
        RuntimeError: the rendezvous failed (torch's error), or an existing group of another rank / size.
    """
    set_comm_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"torch.distributed: expected rank {rank} of {world_size}, got an initialised group with "
                f"rank {dist.get_rank()} of {dist.get_world_size()}"
            )
    else:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return ParallelState(tp_rank=rank, tp_size=world_size)


def all_reduce_min(value: int, parallel: ParallelState, device: torch.device) -> int:
    """The least ``value`` over the ranks of ``parallel.group`` (a collective: every rank calls it); ``value``
    itself with one rank. The tensor lives on ``device`` (NCCL needs a CUDA tensor)."""
    if not parallel.is_parallel:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=parallel.group)
    return int(t.item())


_symm_set_up = 0
"""Symmetric buffers this process set up for a TP group (see :func:`enable_symm_all_reduce`)."""


def enable_symm_all_reduce(parallel: ParallelState, device: torch.device) -> bool:
    """Give the TP group a symmetric buffer of :data:`SYMM_MEM_BYTES` (``lz.distributed.enable_symm_mem``), so
    that ``lz.all_reduce`` may choose the NVLink peer-to-peer kernels for a decode step's small messages
    (``symm_mem.one_shot_push``: 5.0 µs in a graph for a Qwen3-8B hidden state on two H200s, where NCCL takes
    8.0; benchmarks/results/parallel/h200x2_2026-11-30c). A
    collective: every rank calls it, after the group exists and before ``lz.distributed.sync_selection``.
    Nothing on the CPU or with one rank. The ranks agree first (an all-reduce MIN), and all keep NCCL, logged
    with the reason, when any rank has ``LAYERZERO_SYMM_MEM=0`` in its environment or has set up symmetric
    memory before in its process: a second engine in one process (its first group destroyed) hung in
    PyTorch's rendezvous on two H200s. Returns True when the buffer is usable; GPUs without peer access keep
    NCCL, logged with the pairs that lack it.

    Raises:
        ConfigurationError: ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` set to something other than ``"1"``
            (:data:`COMM_ENV`: NVLink multicast stays off).
    """
    global _symm_set_up
    if not parallel.is_parallel or device.type != "cuda":
        return False
    mine = 0 if os.environ.get("LAYERZERO_SYMM_MEM", "1") == "0" else 1 if _symm_set_up else 2
    agreed = all_reduce_min(mine, parallel, device)
    if agreed == 0:
        log.info(
            "symmetric-memory all-reduce off (LAYERZERO_SYMM_MEM=0 on a rank): NCCL for every all-reduce"
        )
        return False
    if agreed == 1:
        log.warning(
            "symmetric-memory all-reduce off for this engine: a rank set it up for an earlier engine in its "
            "process, and PyTorch cannot rendezvous again once that group is gone: NCCL for every all-reduce "
            "(one engine per process keeps it)"
        )
        return False
    buf = lz.distributed.enable_symm_mem(parallel.group, max_bytes=SYMM_MEM_BYTES)
    _symm_set_up += 1
    if not buf.p2p:
        log.warning("symmetric-memory all-reduce unavailable (no peer access: %s): NCCL", buf.why_not)
    return bool(buf.p2p)


def leave_group() -> None:
    """Leave the default process group this process made: forget the synced selections
    (``lz.distributed.unsync``) and the symmetric buffer, then ``destroy_process_group``; errors of a group a
    dead peer left half-gone are swallowed (it is being torn down). Nothing when no group exists."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        lz.distributed.unsync()
        lz.distributed.disable_symm_mem()
        dist.destroy_process_group()
