"""Reference ``lz.linear``: the product in float32 (float64 for float64 inputs), rounded once, written for clarity
(the oracle)."""

from __future__ import annotations

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``: x ``[..., K]``, weight ``[N, K]``, bias ``[N]`` or None -> ``[..., N]`` in x's dtype,
    accumulated in float32 (float64 for float64) and rounded once, as cuBLAS does."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.matmul(x.to(acc), weight.to(acc).t())
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)
