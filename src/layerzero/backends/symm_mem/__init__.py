"""``symm_mem``: symmetric-memory all-reduces over NVLink P2P: PyTorch's (``torch.ops.symm_mem``)
``symm_mem.one_shot`` (``one_shot_all_reduce``: every rank reads every peer's buffer; small messages) and
``symm_mem.two_shot`` (``two_shot_all_reduce_``: reduce-scatter then all-gather through the buffer; medium
messages), and LayerZero's ``symm_mem.one_shot_push`` (:mod:`.push`: one Triton kernel that pushes x into
every peer's buffer, one flag per call, no staging copy; messages <= 1 MiB, Triton). Sum only, CUDA only,
world size 2-8, a message no larger than the group's symmetric buffer, every GPU pair reachable by CUDA peer
access, NVLink multicast off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), and a buffer allocated by
``lz.distributed.enable_symm_mem(group)``; each condition missing is a reason
(``lz.explain("all_reduce", x)``). Hand priorities: push 85, one-shot 80 up to 256 KiB (60 above), two-shot
70, above ``torch_dist.all_reduce``'s 50; they agree with the H200 timings that ship in
``data/timings/nvidia-h200.json`` (``benchmarks/results/parallel/h200x2_2026-11-30c``: in a graph push 4.4-6.1
µs up to 256 KiB and 9.6 µs at 1 MiB, PyTorch's one-shot 7.1-14.4, NCCL 7.4-15.6).
"""

from __future__ import annotations

from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec, KernelSpec

from .._collectives import COMM_DTYPES
from . import buffers, push

ONE_SHOT_MAX_BYTES = 1 << 20
"""One-shot reads W - 1 peers' whole message: past 1 MiB its traffic loses to two-shot and NCCL."""
ONE_SHOT_BEST_BYTES = 256 << 10
_FLOATS = COMM_DTYPES & frozenset({torch.float32, torch.float16, torch.bfloat16})


def _staged(x: torch.Tensor, entry: buffers.SymmBuffer) -> tuple[torch.Tensor, int]:
    """x copied into the group's symmetric buffer, zero-padded to a multiple of ``PAD * W`` bytes; returns
    (the padded flat view in x's dtype, x's element count)."""
    n = x.numel()
    step = buffers.PAD * entry.world_size
    nbytes = -(-(n * x.element_size()) // step) * step
    flat = entry.buf[:nbytes].view(x.dtype)
    flat[:n].copy_(x.reshape(-1))
    flat[n:].zero_()
    return flat, n


def one_shot(x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``torch.ops.symm_mem.one_shot_all_reduce`` of x (sum) through the group's buffer, into a new tensor."""
    entry = buffers.get(_name(group))
    flat, n = _staged(x, entry)
    out = torch.ops.symm_mem.one_shot_all_reduce(flat, "sum", entry.group_name)  # a new, ordinary tensor
    return out[:n].view(x.shape)


def two_shot(x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``torch.ops.symm_mem.two_shot_all_reduce_`` in the group's buffer (sum), copied out to a new tensor."""
    entry = buffers.get(_name(group))
    flat, n = _staged(x, entry)
    torch.ops.symm_mem.two_shot_all_reduce_(flat, "sum", entry.group_name)
    return flat[:n].view(x.shape).clone()


def one_shot_push(x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """:func:`.push.launch` of x (sum) through the group's push buffer, into a new tensor."""
    return push.launch(x, buffers.get(_name(group)).push)


def _name(group: Any) -> str:
    import torch.distributed as dist

    return str((dist.group.WORLD if group is None else group).group_name)


def _check(max_message: int | None):
    def check(ctx: SelectionContext) -> list[Reason]:
        out: list[Reason] = []
        if ctx.comm_backend != "nccl":
            out.append(
                Reason(
                    ReasonCode.COMM_BACKEND_UNSUPPORTED,
                    f"symmetric memory needs an NCCL group on CUDA GPUs; this group's transport is "
                    f"{ctx.comm_backend}",
                )
            )
        if ctx.reduction != "sum":
            out.append(Reason(ReasonCode.REDUCE_OP_UNSUPPORTED, f"sum only, got op={ctx.reduction!r}"))
        if ctx.world_size is None or not 2 <= ctx.world_size <= 8:
            out.append(
                Reason(
                    ReasonCode.WORLD_SIZE_UNSUPPORTED,
                    f"world size 2-8 (one NVLink domain), got {ctx.world_size}",
                )
            )
        if not buffers.multicast_off():
            out.append(
                Reason(
                    ReasonCode.MULTICAST_ENABLED,
                    f"{buffers.MULTICAST_ENV} is not '1': NVLink multicast could be used, and LayerZero "
                    f"keeps it off (export {buffers.MULTICAST_ENV}=1 or call lz.distributed.enable_symm_mem)",
                )
            )
        entry = buffers.get(ctx.comm_group)
        if entry is None:
            out.append(
                Reason(
                    ReasonCode.SYMM_MEM_UNAVAILABLE,
                    f"no symmetric buffer for process group {ctx.comm_group!r}: call "
                    "lz.distributed.enable_symm_mem(group) on every rank (CUDA, NCCL)",
                )
            )
        elif not entry.p2p:
            out.append(
                Reason(ReasonCode.P2P_UNAVAILABLE, f"no CUDA peer access (NVLink P2P): {entry.why_not}")
            )
        limit = entry.max_bytes if entry is not None else None
        if max_message is not None:
            limit = max_message if limit is None else min(limit, max_message)
        if limit is not None and (ctx.message_bytes or 0) > limit:
            out.append(
                Reason(
                    ReasonCode.MESSAGE_TOO_LARGE,
                    f"message bucket {ctx.message_bytes} bytes > limit {limit} bytes",
                )
            )
        return out

    return check


_CHECK_PUSH_MESSAGE = _check(push.SLOT_BYTES)
"""The shared conditions of the symm_mem kernels, messages up to the push kernel's slot."""


def _check_push(ctx: SelectionContext) -> list[Reason]:
    out = _CHECK_PUSH_MESSAGE(ctx)
    entry = buffers.get(ctx.comm_group)
    if entry is not None and entry.p2p and entry.push is None:
        out.append(Reason(ReasonCode.SYMM_MEM_UNAVAILABLE, f"no push buffer: {entry.push_why_not}"))
    return out


def _one_shot_priority(ctx: SelectionContext) -> int:
    return 80 if (ctx.message_bytes or 0) <= ONE_SHOT_BEST_BYTES else 60


def register(registry: KernelRegistry) -> None:
    """Add the symm_mem backend (unavailable, with a reason, without ``torch.ops.symm_mem``) and its two
    all-reduce kernels."""
    ok = torch.distributed.is_available() and hasattr(torch.ops.symm_mem, "one_shot_all_reduce")
    registry.add_backend(
        BackendSpec(
            "symm_mem",
            "torch.distributed._symmetric_memory",
            torch.__version__,
            ok,
            ()
            if ok
            else (Reason(ReasonCode.BACKEND_NOT_INSTALLED, "this torch build has no torch.ops.symm_mem"),),
            description="PyTorch symmetric-memory all-reduce over NVLink P2P (multicast off)",
        )
    )
    common = dict(
        device_types=frozenset({"cuda"}),
        dtypes=_FLOATS,
        sm_min=(8, 0),
        supports_backward=False,
        graph_safe=True,
    )
    registry.add_kernel(
        KernelSpec(
            "symm_mem.one_shot",
            "all_reduce",
            one_shot,
            priority=80,
            priority_for=_one_shot_priority,
            check=_check(ONE_SHOT_MAX_BYTES),
            description="symm_mem one_shot_all_reduce (NVLink P2P, messages <= 1 MiB)",
            **common,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "symm_mem.one_shot_push",
            "all_reduce",
            one_shot_push,
            priority=85,
            check=_check_push,
            description="LayerZero's one-shot all-reduce (Triton: x pushed to every peer, one flag per call)",
            **common,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "symm_mem.two_shot",
            "all_reduce",
            two_shot,
            priority=70,
            check=_check(None),
            description="symm_mem two_shot_all_reduce_ (NVLink P2P, up to the symmetric buffer size)",
            **common,
        )
    )
