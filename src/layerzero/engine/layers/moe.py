"""Sparse mixture-of-experts MLP (Qwen3-MoE): a softmax router over E experts, top-k per token, SwiGLU experts
(the experts through the dispatched ``lz.fused_moe``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import layerzero as lz

from ..config import MoEConfig

__all__ = ["SparseMoE", "route"]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: ``softmax`` in float32 over E experts, the ``top_k`` largest per token, renormalised to sum to
    1 when ``renormalize`` (the config's ``norm_topk_prob``), as transformers' Qwen3-MoE router does.
    router_logits ``[T, E]`` -> (weights ``[T, top_k]`` float32, expert ids ``[T, top_k]`` int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """Experts' packed weights: ``w13`` ``[E, 2I, H]`` (gate rows then up rows), ``w2`` ``[E, H, I]``; router
    ``gate`` ``[E, H]``. forward: x ``[T, H]`` -> ``sum_k w_k * expert_{id_k}(x)`` ``[T, H]``."""

    def __init__(self, hidden: int, moe: MoEConfig, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Parameter(torch.empty(e, hidden, device=device, dtype=dtype), requires_grad=False)
        self.w13 = nn.Parameter(
            torch.empty(e, 2 * i, hidden, device=device, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(torch.empty(e, hidden, i, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> ``[T, H]`` (x's dtype): routing here, the experts through
        :func:`layerzero.fused_moe`."""
        weights, ids = route(F.linear(x, self.gate), self.top_k, self.renormalize)
        return lz.fused_moe(x, self.w13, self.w2, weights, ids)

    def load(self, tensor: torch.Tensor, what: str, expert: int | None = None) -> None:
        """Copy a checkpoint tensor: ``what`` in ``gate`` (router ``[E, H]``), ``gate_proj`` / ``up_proj`` /
        ``down_proj`` of one ``expert`` (per-expert tensors, the hub's format), or ``gate_up_proj`` /
        ``down_proj`` of all experts (transformers 5's fused ``[E, 2I, H]`` / ``[E, H, I]``)."""
        i = self.w2.shape[2]
        if what == "gate":
            self.gate.copy_(tensor)
        elif expert is None:
            (self.w13 if what == "gate_up_proj" else self.w2).copy_(tensor)
        elif what == "gate_proj":
            self.w13[expert, :i].copy_(tensor)
        elif what == "up_proj":
            self.w13[expert, i:].copy_(tensor)
        else:
            self.w2[expert].copy_(tensor)
