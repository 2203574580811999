"""Host buffers the grammar backends fill a step's token bitmask into, so the worker copies it to the device
in one non-blocking transfer with no staging copy (docs/decoding.md, "Structured outputs").

One buffer is a flat int32 tensor, pinned when CUDA is available: the step's row indices (int32) first, then,
from the next multiple of 4 words (16 bytes), the ``[R, W]`` bitmask. Two buffers alternate by step parity
(:class:`BitmaskBuffers`): a step's buffer is not written again until the step after next, and a CUDA event
recorded after its copy (:meth:`HostBitmask.to_device`) is waited on before that (already passed in the
ordinary course: async scheduling reads the previous step's tokens first), so an H2D copy still in flight is
never overwritten."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BitmaskBuffers", "HostBitmask"]


def _bits_offset(rows: int) -> int:
    """Where the bitmask starts in a buffer (int32 words): after ``rows`` indices, 16-byte aligned."""
    return -(-rows // 4) * 4


class HostBitmask:
    """One host buffer (see the module docstring): :meth:`claim` returns numpy views to fill; after the fill
    :meth:`set_rows` records how many leading rows are kept; :meth:`to_device` copies them."""

    __slots__ = ("event", "generation", "offset", "rows", "tensor", "width")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        self.rows = self.offset = self.width = 0
        self.generation = 0  # claims so far: a filled bitmask names the one it was filled in

    def claim(self, rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Views ``(indices [rows] int32, bits [rows, width] int32)`` of this buffer (grown when too small),
        once the device has read its previous contents. ``bits`` holds an earlier fill's words: the caller
        writes every row (a backend's fill writes whole rows)."""
        if self.event is not None:
            self.event.synchronize()  # the copy of the step before last (normally long done)
        off = _bits_offset(rows)
        need = off + rows * width
        if self.tensor is None or self.tensor.numel() < need:
            cap = 1 << max(need - 1, 1).bit_length()
            self.tensor = torch.empty(cap, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        flat = self.tensor.numpy()
        self.rows, self.offset, self.width = rows, off, width
        self.generation += 1
        return flat[:rows], flat[off : off + rows * width].reshape(rows, width)

    def set_rows(self, rows: int) -> None:
        """Keep the first ``rows`` indices and bitmask rows (the rest were dropped: all tokens allowed)."""
        self.rows = rows

    def to_device(self, device: torch.device, generation: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices [R] int32, bits [R, W] int32)`` of the fill of claim number ``generation`` on
        ``device``: views of the buffer on CPU; on CUDA one non-blocking copy of its used prefix (then an
        event is recorded: :meth:`claim` waits on it before the buffer is written again).

        Raises:
            RuntimeError: the buffer holds another fill (claimed again before this one was applied: a bug, the
                bitmask would be another step's).
        """
        if self.tensor is None or generation != self.generation:
            raise RuntimeError(
                f"structured outputs: the host bitmask buffer holds fill {self.generation}, not "
                f"{generation}: it was claimed again before this step's bitmask was applied (two steps in "
                "flight on one parity: an engine bug)"
            )
        r, off, w = self.rows, self.offset, self.width
        used = self.tensor[: off + r * w]
        if device.type == "cuda":
            used = used.to(device, non_blocking=True)
            if self.event is None:
                self.event = torch.cuda.Event()
            self.event.record()
        return used[:r], used[off : off + r * w].view(r, w)


class BitmaskBuffers:
    """Two :class:`HostBitmask` buffers used by step parity (:meth:`next` alternates)."""

    def __init__(self) -> None:
        self._buffers = (HostBitmask(), HostBitmask())
        self._step = 0

    def next(self) -> HostBitmask:
        """The buffer of the next step's fill."""
        self._step += 1
        return self._buffers[self._step % 2]
