"""Shared pieces of the ``triton`` backend: constraint constants, the lazy kernel-module loader, launch
heuristics and the ``_missing`` callable of an unusable backend.

Nothing here imports triton: the ``@triton.jit`` code lives in ``_norm_kernels.py``, ``_rope_kernels.py``
and ``_sampling_kernels.py``, imported by :func:`kernels` on a kernel's first call (after the backend's
probe imported triton successfully).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from layerzero.backends._optional import missing_kernel

log = logging.getLogger("layerzero.backends.triton")
CUDA = frozenset({"cuda"})
FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
SM_MIN = (8, 0)
"""Triton's supported NVIDIA range starts at compute capability 8.0 (and bfloat16 needs it)."""
INSTALL_HINT = "pip install triton (Linux x86_64/aarch64; torch's CUDA wheels ship a matching one)"


class LazyModule:
    """A kernel module imported on first use: ``LazyModule("_norm_kernels").get()`` returns
    ``layerzero.backends.triton._norm_kernels`` (importing it, hence running its ``@triton.jit``
    decorators, once). Holds one module reference; no other state.

    Raises (from :meth:`get`):
        ImportError: triton is not importable (only reached if a caller bypasses the probe).
    """

    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = f"layerzero.backends.triton.{name}"
        self._module: ModuleType | None = None

    def get(self) -> ModuleType:
        """The imported kernel module."""
        mod = self._module
        if mod is None:
            mod = self._module = importlib.import_module(self._name)
        return mod


def rows_2d(t: torch.Tensor, name: str, kernel_id: str) -> torch.Tensor:
    """``t`` ``[..., N]`` as a 2-D ``[rows, N]`` view (no copy), or a contiguous copy when the leading dims
    cannot be merged into one row stride (e.g. a transposed ``[S, B, N]`` view; logged at DEBUG level)."""
    n = t.shape[-1]
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, n)
    except RuntimeError:
        log.debug(
            "%s: %s with strides %s cannot be viewed as [rows, %d]; copying it to contiguous memory",
            kernel_id,
            name,
            tuple(t.stride()),
            n,
        )
        return t.reshape(-1, n)


def projection_out(
    x: torch.Tensor, n: int, kernel_id: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A projection's output ``[..., N]`` (new, x's dtype and device) and the 2-D views its kernel reads and
    writes: ``(out, x [rows, K], out [rows, N])`` (see :func:`rows_2d`)."""
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    return out, rows_2d(x, "x", kernel_id), out.view(-1, n)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (grid sizes)."""
    return -(-a // b)


def num_warps_for(block: int) -> int:
    """Warps per program for a row tile of ``block`` elements (the Triton tutorials' layer-norm rule)."""
    if block >= 32768:
        return 16
    if block >= 8192:
        return 8
    if block >= 2048:
        return 4
    return 2 if block >= 512 else 1


def missing(kernel_id: str, why: str) -> Callable[..., Any]:
    """:func:`layerzero.backends._optional.missing_kernel` with the Triton install hint."""
    return missing_kernel(kernel_id, why, INSTALL_HINT)


def kernel_scale(scale: Any) -> Any:
    """A quantized KV cache's scale as our Triton kernels take it: a tensor as is (a pointer, read on the
    device: graph replays see later values), a number as a float, None as 1.0 (``core.kv_quant``'s
    default)."""
    if scale is None:
        return 1.0
    return scale if isinstance(scale, torch.Tensor) else float(scale)
