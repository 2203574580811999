"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``"ngram"`` method). Host side, no model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["ngram_propose"]


def ngram_propose(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for a sequence whose known tokens (prompt and output) are ``tokens``.

    For n from ``n_max`` down to ``n_min``: the last n tokens are the pattern; if it occurs earlier (a match
    starting before ``len(tokens) - n``), the drafts are the k tokens after its latest occurrence that has k
    tokens after it, else after its earliest occurrence (the longest continuation: in a loop shorter than k,
    e.g. one token repeated, the latest match has fewer tokens after it). No match at any n: no drafts
    (``[]``; the sequence then decodes one token this step).

    Args:
        tokens: the sequence's token ids, oldest first.
        k: most drafts (>= 1); n_min, n_max: pattern sizes, 1 <= n_min <= n_max.

    Returns:
        The drafts (a list of 0..k token ids)."""
    size = len(tokens)
    if size < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = arr[size - n :]
        windows = sliding_window_view(arr[: size - 1], n)  # windows starting at 0 .. size - 1 - n
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= size]  # matches followed by k known tokens
            start = int(full[-1] if full.size else hits[0]) + n
            return arr[start : start + k].tolist()
    return []
