"""Shared constraints of the collective kernels (``reference``, ``torch_dist``, ``symm_mem``): no backend."""

from __future__ import annotations

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.reasons import Reason, ReasonCode

COMM_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}
)
"""What every collective kernel moves (``layerzero.ops.collectives.COMM_DTYPES`` checks the same set)."""


def graph_reasons(ctx: SelectionContext) -> list[Reason]:
    """A torch.distributed collective is capturable in a CUDA graph only on NCCL (Gloo and the others run on
    host threads)."""
    if ctx.graph_capture and ctx.comm_backend != "nccl":
        return [
            Reason(
                ReasonCode.CUDA_GRAPH_UNSAFE,
                f"a {ctx.comm_backend} collective cannot be captured in a CUDA graph (only NCCL on CUDA can)",
            )
        ]
    return []
