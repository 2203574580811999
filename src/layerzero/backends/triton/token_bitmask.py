"""``triton.apply_token_bitmask``: ``lz.apply_token_bitmask`` in one fused Triton kernel, CUDA only (SM >=
8.0).

One launch over (masked row, block of ``BLOCK`` tokens) programs (``_token_bitmask_kernels.py``): each tests
its tokens' bits and writes -inf in place, so the step's structured rows cost one pass over their logits and
no temporary (the torch form builds a ``[R, 32 W]`` bool tensor and, with indices, gathers and scatters the
rows). Graph-safe: no host synchronization, no allocation; rows and indices are read on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.specs import KernelSpec

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, cdiv, missing
from ._launch import launch

__all__ = ["BLOCK", "KERNEL_ID", "apply_token_bitmask", "kernel_spec"]

KERNEL_ID = "triton.apply_token_bitmask"
PRIORITY = 40
"""Above xgrammar (30) and torch_native (10): one pass, no temporaries; not yet measured on the H200."""
BLOCK = 1024
"""Tokens per program (32 words): a power of two and a multiple of 32."""
_KERNELS = LazyModule("_token_bitmask_kernels")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    """Ban the tokens ``bitmask`` does not allow in the rows of ``logits`` it names, in place.

    Args:
        logits: ``[R_all, V]`` float16/bfloat16/float32, ``stride(-1) == 1``; written in place.
        bitmask: ``[R, W]`` int32, ``stride(-1) == 1``: bit ``j`` of word ``w`` = token ``32 w + j``
            allowed; ids from ``32 W`` on banned.
        indices: ``[R]`` int64/int32 distinct logits rows, or None (row ``i`` -> row ``i``).

    Raises:
        Nothing of its own (``lz.apply_token_bitmask`` validates); triton's compile/launch errors propagate.
    """
    rows, width = bitmask.shape
    vocab = logits.shape[1]
    if rows == 0:
        return
    mod = _KERNELS.get()
    launch(
        mod._apply_token_bitmask,
        (rows, cdiv(vocab, BLOCK)),
        logits,
        bitmask,
        bitmask if indices is None else indices,  # unread without indices
        logits.stride(0),
        bitmask.stride(0),
        vocab,
        width,
        HAS_INDICES=indices is not None,
        BLOCK=BLOCK,
        num_warps=4,
    )


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.apply_token_bitmask`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with
    ``why``) when ``available`` is False."""
    fn: Callable[..., Any] = apply_token_bitmask if available else missing(KERNEL_ID, why)
    return KernelSpec(
        KERNEL_ID,
        "apply_token_bitmask",
        fn,
        priority=PRIORITY,
        description="one fused pass: each (row, token block) tests its bits and writes -inf in place",
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
    )
