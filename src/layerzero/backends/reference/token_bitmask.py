"""Reference ``lz.apply_token_bitmask``: each masked row's allowed-token flags read bit by bit from its words,
then -inf written where a flag is off (plain PyTorch, written for clarity; the oracle of the faster
kernels)."""

from __future__ import annotations

import torch

__all__ = ["apply_token_bitmask"]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    """Set ``logits[indices[i], t] = -inf`` for every token ``t`` that bit ``t % 32`` of word ``t // 32`` of
    ``bitmask[i]`` does not allow (ids from ``32 W`` on are never allowed), in place.

    Args:
        logits: ``[R_all, V]`` float (any float dtype), written in place.
        bitmask: ``[R, W]`` int32, bit ``j`` of word ``w`` = token ``32 w + j`` allowed.
        indices: ``[R]`` int64/int32 distinct logits rows, or None (row ``i`` masks row ``i``).

    Raises:
        Nothing of its own: validation is the ops layer's job (``lz.apply_token_bitmask``).
    """
    vocab, width = logits.shape[1], bitmask.shape[1]
    token = torch.arange(vocab, device=logits.device)
    word = token // 32
    covered = word < width  # ids past the words' 32 W are banned
    words = bitmask.long()[:, word.clamp(max=width - 1)]  # [R, V]: each token's word
    allowed = ((words >> (token % 32)) & 1).bool() & covered
    rows = torch.arange(bitmask.shape[0], device=logits.device) if indices is None else indices.long()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
