"""Reference fused MoE: the oracle of every fused_moe kernel.

Plain PyTorch, one expert at a time, computed in float32 (float64 when x is float64), returned in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_moe"]


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Sparse MoE experts with SwiGLU (Shazeer et al. 2017; Mixtral): for each expert e, gather the (token,
    slot) pairs routed to it, run its MLP ``w2[e] @ (silu(gate) * up)`` on those tokens and add the outputs,
    scaled by the router weights, into the tokens' rows (the loop of transformers'
    ``Qwen3MoeExperts.forward``, without its intermediate roundings).

    Args:
        x: ``[T, H]`` tokens.
        w13: ``[E, 2I, H]``, per expert gate rows then up rows (x's dtype).
        w2: ``[E, H, I]`` down projections (x's dtype).
        topk_weights: ``[T, K]`` router weights (float32).
        topk_ids: ``[T, K]`` expert ids in ``[0, E]`` (int32/int64); ``E``: no expert (the loop over
            experts never meets it, so the slot adds nothing).

    Returns:
        out ``[T, H]`` in x's dtype; every product and sum in float32 (float64 for float64), rounded once.

    Raises:
        Nothing of its own: input validation is the ops layer's job.

    >>> x = torch.tensor([[1.0, 2.0]])
    >>> w13 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]); w2 = torch.ones(1, 2, 1)
    >>> fused_moe(x, w13, w2, torch.tensor([[0.5]]), torch.tensor([[0]]))  # 0.5 * silu(1) * 2 in both columns
    tensor([[0.7311, 0.7311]])
    """
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inter = w2.shape[2]
    xc = x.to(cdt)
    out = torch.zeros(x.shape, dtype=cdt, device=x.device)
    for e in range(w13.shape[0]):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)  # the pairs routed to expert e
        if tokens.numel() == 0:
            continue
        gate_up = xc[tokens] @ w13[e].to(cdt).T  # [n, 2I]
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        y = h @ w2[e].to(cdt).T  # [n, H]
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].to(cdt)[:, None])
    return out.to(x.dtype)
