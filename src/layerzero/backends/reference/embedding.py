"""Reference ``lz.embedding``: ``weight.index_select(0, ids)``, written for clarity (the oracle)."""

from __future__ import annotations

import torch


def embedding(input_ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """``out[..., :] = weight[input_ids[...], :]``: ids ``[...]`` (int32/int64, in ``[0, V)``), weight
    ``[V, H]`` -> ``[..., H]`` in weight's dtype (exact row copies). ``padding_idx`` (in ``[0, V)`` or None)
    is the row that gets no gradient, as ``torch.nn.functional.embedding``: it is read through a detached copy
    of the table."""
    table = weight
    if padding_idx is not None and weight.requires_grad and torch.is_grad_enabled():
        rows = torch.arange(weight.shape[0], device=weight.device)[:, None]
        table = torch.where(rows == padding_idx, weight.detach(), weight)
    flat = table.index_select(0, input_ids.reshape(-1))  # [N, H]
    return flat.reshape(*input_ids.shape, weight.shape[1])
