"""Reference token samplers (top-k, top-p / nucleus): the oracles for sampling kernels.

Plain PyTorch: probabilities in float32 (float64 for float64 logits), draws with ``torch.multinomial``
on the caller's ``torch.Generator`` so a fixed seed gives the same tokens.
"""

from __future__ import annotations

import torch

__all__ = ["sample_topk", "sample_topp"]


GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)
"""Temperatures below this (float32's smallest normal, ~1.18e-38; ``lz.sample_*`` already maps them to 0) are
greedy: ``1 / T`` would not fit in float32, and the T -> 0+ limit of the softmax is one-hot at the maximum."""


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the vocabulary, float32 (float64 for float64 logits), computed as
    ``softmax((logits - rowmax) / temperature)``: equal in exact arithmetic, but a tiny temperature sends the
    non-maximal entries to ``-inf`` (probability 0) instead of overflowing ``logits / T`` to ``inf`` (NaN)."""
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt)
    return torch.softmax((x - x.amax(dim=-1, keepdim=True)) / float(temperature), dim=-1)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1).to(torch.int64)


def sample_topk(
    logits: torch.Tensor,
    k: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Top-k sampling (Fan et al. 2018): draw from the k most probable tokens, renormalized.

    Steps: ``p = softmax(logits / temperature)``; keep the k largest (``torch.topk`` order, which also
    decides ties at the k-th place); renormalize; draw one token per row with
    ``torch.multinomial(generator=generator)``.

    Args:
        logits: ``[B, V]`` (B batch rows, V vocabulary size), any float dtype.
        k: number of tokens kept (int >= 1); ``k >= V`` means no truncation.
        temperature: softmax temperature (> 0); ``temperature == 0`` (or below :data:`GREEDY_BELOW`) means
            greedy: ``argmax`` of the logits (first index on ties), no random draw and ``generator`` untouched.
        generator: ``torch.Generator`` on logits' device, or None for the global RNG.

    Returns:
        Token ids ``[B]``, int64, each in ``[0, V)``.

    Raises:
        Nothing of its own: validation (k >= 1, temperature >= 0, rank 2) is the ops layer's job.

    >>> sample_topk(torch.tensor([[0.0, 5.0, 1.0]]), k=1)
    tensor([1])
    """
    if temperature < GREEDY_BELOW:
        return _greedy(logits)
    probs = _probs(logits, temperature)  # [B, V]
    k = min(int(k), probs.shape[-1])
    top_p, top_idx = torch.topk(probs, k, dim=-1)  # [B, k], descending
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    choice = torch.multinomial(top_p, 1, generator=generator)  # [B, 1] positions within the top k
    return top_idx.gather(-1, choice).squeeze(-1).to(torch.int64)


def sample_topp(
    logits: torch.Tensor,
    p: float,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Nucleus (top-p) sampling (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration").

    Steps: ``probs = softmax(logits / temperature)``; sort descending (stable: on equal probabilities the
    lower token id ranks first); keep the smallest prefix whose cumulative probability is ``>= p``, that is
    every token whose cumulative probability *before* it is ``< p`` (the most probable token is always
    kept); renormalize; draw one token per row with ``torch.multinomial(generator=generator)``.

    Args:
        logits: ``[B, V]`` (B batch rows, V vocabulary size), any float dtype.
        p: cumulative probability mass kept, in (0, 1]; ``p >= 1.0`` means no truncation (so float
            rounding in the cumulative sum never drops tail tokens).
        temperature: softmax temperature (> 0); ``temperature == 0`` (or below :data:`GREEDY_BELOW`) means
            greedy ``argmax`` (first index on ties).
        generator: ``torch.Generator`` on logits' device, or None for the global RNG.

    Returns:
        Token ids ``[B]``, int64, each in ``[0, V)``.

    Raises:
        Nothing of its own: validation (0 < p <= 1, temperature >= 0, rank 2) is the ops layer's job.

    >>> sample_topp(torch.tensor([[0.0, 9.0, 1.0]]), p=0.5)
    tensor([1])
    """
    if temperature < GREEDY_BELOW:
        return _greedy(logits)
    probs = _probs(logits, temperature)  # [B, V]
    if p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(torch.int64)
    sorted_p, sorted_idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    mass_before = torch.cat((torch.zeros_like(cum[..., :1]), cum[..., :-1]), dim=-1)  # mass ranked above
    keep = mass_before < p
    keep[..., 0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    kept = kept / kept.sum(dim=-1, keepdim=True)
    choice = torch.multinomial(kept, 1, generator=generator)  # [B, 1] positions in sorted order
    return sorted_idx.gather(-1, choice).squeeze(-1).to(torch.int64)
