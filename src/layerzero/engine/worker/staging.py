"""Host -> device transfers of a step's small arrays without synchronizing: packed into one pinned buffer and
copied in one non-blocking transfer (``torch.tensor(list, device="cuda")`` is a blocking copy: it waits for
every kernel already queued, which would stall async scheduling's overlap)."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["offsets", "stage", "to_device"]

_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}
ALIGN = 16
"""Bytes each array's offset in the packed buffer is a multiple of."""


def offsets(nbytes: list[int]) -> tuple[list[int], int]:
    """Offsets (bytes) of arrays of ``nbytes`` bytes packed in order at :data:`ALIGN`-byte boundaries, and the
    packed size (at least :data:`ALIGN`): the layout :func:`to_device` writes.

    >>> offsets([8, 20, 0, 4])
    ([0, 16, 48, 48], 64)
    """
    out, total = [], 0
    for n in nbytes:
        out.append(total)
        total += -(-n // ALIGN) * ALIGN
    return out, max(total, ALIGN)


def stage(arrays: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """``arrays`` packed at their :func:`offsets` into one uint8 host buffer (pinned when ``device`` is CUDA):
    ``(buffer, offsets)``, the buffer exactly the packed size. What :func:`to_device` copies; a caller that
    keeps its own views of the destination (the engine's packed decode buckets) copies it itself."""
    offs, total = offsets([a.nbytes for a in arrays])
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf = host.numpy()
    for a, o in zip(arrays, offs, strict=True):
        buf[o : o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return host, offs


def to_device(
    arrays: list[np.ndarray], device: torch.device, out: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """``arrays`` (int64 / int32 / float32, any shape) as tensors on ``device``, in order.

    On CUDA: each array at an :func:`offsets` position of one pinned host buffer, one non-blocking copy, then
    views with the arrays' dtypes and shapes (one pinned allocation and one copy instead of one of each per
    array, ~20 µs of host time each); the caching host allocator keeps the pinned buffer until the copy ran.
    Elsewhere: ``torch.from_numpy`` (no copy).

    ``out``: a uint8 tensor on ``device`` of at least the packed size: the arrays are copied into it (on CUDA
    the one non-blocking copy lands there, stream-ordered after the work already queued) and the views are of
    ``out``, at the same offsets whatever the arrays' values: a CUDA graph captured over those views reads
    them (the engine's packed decode inputs, ``runner/cuda_graph.py``).

    Raises:
        KeyError: an array of another dtype.
        ValueError: ``out`` smaller than the packed size, or not uint8.
    """
    if device.type != "cuda" and out is None:
        return [torch.from_numpy(a) for a in arrays]
    host, offs = stage(arrays, device)
    total = host.numel()
    if out is not None and (out.dtype != torch.uint8 or out.numel() < total):
        raise ValueError(
            f"to_device: out: expected a uint8 tensor of >= {total} bytes, got {out.dtype} [{out.numel()}]"
        )
    if out is None:
        dev = host.to(device, non_blocking=True)
    else:
        dev = out
        dev[:total].copy_(host, non_blocking=device.type == "cuda")
    return [
        dev[o : o + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
        for a, o in zip(arrays, offs, strict=True)
    ]
