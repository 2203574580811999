"""Reference ``linear_cross_entropy``: the full logits in float32 (float64 for float64), then PyTorch's
``F.cross_entropy``: the clear definition, O(N x V) memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy", "out_dtype"]


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss dtype of ``lz.linear_cross_entropy``: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
) -> torch.Tensor:
    """``F.cross_entropy(softcap(hidden @ weight.T + bias), target, ...)`` with hidden ``[N,
    H]``, weight ``[V, H]``, target ``[N]`` int64, bias ``[V]`` or None; returns a 0-dim loss or ``[N]``
    (reduction "none") in :func:`out_dtype` (math in that dtype)."""
    acc = out_dtype(hidden.dtype)
    logits = hidden.to(acc) @ weight.to(acc).T
    if bias is not None:
        logits = logits + bias.to(acc)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
