"""``symm_mem.one_shot_push``: LayerZero's own one-shot all-reduce over symmetric memory, one Triton kernel,
one flag per call and no staging copy (issue 38: "a decode step's small all-reduce <= 6 µs in a graph").

PyTorch's ``one_shot_all_reduce`` needs its input in the symmetric buffer (a staging copy: a second kernel),
then runs a barrier, reads every peer's buffer over NVLink and runs a second barrier so that no rank
overwrites its buffer while a peer still reads it: two round trips of flags. This kernel instead *pushes*:

1. program ``pid`` stores its chunks of x straight from x into slot ``rank`` of every rank's buffer;
2. it sets flag ``[pid, rank]`` of every rank to its call counter ``e`` (release, system scope);
3. it waits until its own flags ``[pid, *]`` reached ``e`` (acquire), then sums the slots of its own
   buffer, all local reads, in rank order (float32: every rank gets bitwise the same sum).

The second barrier goes away with double buffering: the buffer has two parities and call ``e`` uses parity
``e % 2``. A rank writes parity ``p`` again at call ``e + 2`` only after it saw every peer's flag ``e + 1``,
which a peer sets in a kernel that starts after its call-``e`` kernel (the one that read parity ``p``)
finished. ``e`` is a per-program counter in device memory (``epochs[pid]``, advanced by the kernel itself),
so the same kernel replays correctly inside a CUDA graph. Program ``pid`` always owns the same bytes of the
buffer (chunk ``pid`` of ``CHUNK_BYTES``, whatever the message's dtype or size), so each program's counter,
parity and flags concern its bytes only; programs without a chunk in a call (a smaller message) do not run
and do not advance. This is the scheme of vLLM's custom all-reduce (per-block flags, two parities) with
the data pushed instead of pulled, as in TensorRT-LLM's one-shot "push" mode.

Buffer layout (one symmetric ``uint8`` allocation per group, :func:`allocate`): ``[2 parities][W slots]
[SLOT_BYTES]`` of data, then ``[GRID][W]`` int32 flags. Every rank makes the same calls in the same order
(an all-reduce's contract), so the counters advance in lockstep.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from .._optional import import_modules

SLOT_BYTES = 1 << 20
"""The largest message (bytes per rank): one-shot moves W copies of it, past ~1 MiB two-shot and NCCL win."""
CHUNK_BYTES = 8 << 10
"""Bytes of one program's chunk: a 4,096-wide bf16 row (a decode step's hidden state) is one chunk."""
GRID = SLOT_BYTES // CHUNK_BYTES
"""Programs at most, one per chunk (128; an H200 has 132 SMs): chunk ``c`` is always program ``c``'s."""


@dataclass(frozen=True, slots=True)
class PushState:
    """One group's push buffer: the symmetric allocation ``buf`` (kept alive, with its ``handle``), every
    rank's base address ``bases`` (int64 ``[W]`` on this GPU), this rank's per-program call counters
    ``epochs`` (int32 ``[GRID]``), the rank and world size."""

    buf: torch.Tensor
    handle: Any
    bases: torch.Tensor
    epochs: torch.Tensor
    rank: int
    world_size: int

    @property
    def flags_offset(self) -> int:
        """Byte offset of the flags ``[GRID][W]`` int32 in every rank's buffer."""
        return 2 * self.world_size * SLOT_BYTES


def buffer_bytes(world_size: int) -> int:
    """Bytes of one rank's push buffer: two parities of W slots, then the flags."""
    return 2 * world_size * SLOT_BYTES + GRID * world_size * 4


def allocate(group: Any, device: torch.device) -> PushState:
    """Allocate, zero and rendezvous ``group``'s push buffer (a collective: every rank of the group calls it,
    after peer access was checked): :func:`buffer_bytes` bytes of symmetric memory on ``device``. Returns
    after every rank zeroed its flags (a barrier), so no peer's first flag can be wiped.

    Raises:
        RuntimeError: from ``torch.distributed._symmetric_memory`` when the allocation or the rendezvous fails
            (``lz.distributed.enable_symm_mem`` checked the group, its transport and peer access before).
    """
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    buf = symm.empty(buffer_bytes(world), dtype=torch.uint8, device=device)
    buf.zero_()
    handle = symm.rendezvous(buf, group)
    delta = buf.data_ptr() - int(
        handle.buffer_ptrs[rank]
    )  # the tensor's offset in its allocation (symmetric)
    bases = torch.tensor([int(p) + delta for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
    epochs = torch.zeros(GRID, dtype=torch.int32, device=device)
    torch.cuda.synchronize(device)
    dist.barrier(group)
    return PushState(buf, handle, bases, epochs, rank, world)


def triton_missing() -> str:
    """Why the kernel cannot run here ('' when it can): Triton not importable (the backends' shared probe)."""
    _, reason = import_modules(
        "triton", ["triton"], "pip install triton (it comes with CUDA builds of torch)"
    )
    return "" if reason is None else reason.message


@functools.cache
def _kernel() -> Any:
    """The ``@triton.jit`` kernel, its module imported on the first call only."""
    return importlib.import_module(f"{__package__}._push_kernels").one_shot_push_all_reduce


def launch(x: torch.Tensor, state: PushState) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``state``'s group, a new tensor (x is not written).

    Args:
        x: any shape, float32 / float16 / bfloat16 on this rank's GPU, at most :data:`SLOT_BYTES` bytes (the
            kernel's check refuses larger messages before dispatch); made contiguous when it is not.
        state: the group's :class:`PushState`.

    Returns:
        x's shape and dtype: the float32-accumulated sum in rank order, bitwise equal on every rank.

    Raises nothing of its own: the KernelSpec's check refuses, with reasons, what it cannot take (a message
    over :data:`SLOT_BYTES`, no push buffer, another dtype or device) before dispatch. A collective: every
    rank of the group makes the same calls in the same order, or the kernel waits for a peer's flag.
    Follows vLLM's custom all-reduce (per-block flags, two parities), with TensorRT-LLM's push of the data.
    """
    kern = _kernel()
    src = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(src)
    n = src.numel()
    if n == 0:
        return out
    block = CHUNK_BYTES // src.element_size()
    grid = -(-n // block)  # <= GRID: the kernel's check refuses messages over SLOT_BYTES
    kern[(grid,)](
        src,
        out,
        state.bases,
        state.epochs,
        n,
        state.rank,
        FLAGS_OFFSET=state.flags_offset,
        PARITY_BYTES=state.world_size * SLOT_BYTES,
        SLOT_BYTES=SLOT_BYTES,
        CHUNK_BYTES=CHUNK_BYTES,
        WORLD=state.world_size,
        BLOCK=block,
        num_warps=4,  # 128 threads for one 8 KiB chunk: 32 bf16 elements a thread
    )
    return out
