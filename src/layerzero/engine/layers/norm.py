"""RMSNorm through ``lz.rms_norm`` (fused residual add when given)."""

from __future__ import annotations

import torch
from torch import nn

import layerzero as lz

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (Zhang & Sennrich 2019) with weight ``[H]``; see
    :func:`layerzero.rms_norm`."""

    def __init__(self, hidden_size: int, eps: float, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x ``[..., H]`` -> normalised x; with ``residual`` (like x) ->
        ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return lz.rms_norm(x, self.weight, self.eps)
        return lz.rms_norm(x, self.weight, self.eps, residual=residual)
