"""Token restrictions applied to a step's float32 logits before the draw: ``allowed_token_ids`` and bad words
(every banned token's logit becomes -inf; vLLM v1's ``AllowedTokenIdsLogitsProcessor`` and bad-words rule).
Structured-output grammar bitmasks are a separate call."""

from __future__ import annotations

import numpy as np
import torch

from ..core.sched.output import SamplingMetadata
from .staging import to_device

__all__ = ["bad_word_bans", "bad_words_tail", "restrict_tokens"]


def bad_words_tail(words: tuple[tuple[int, ...], ...] | None) -> int:
    """How many of a row's last output tokens the bad-words rule reads: the longest word's length minus one
    (0 without words or with single-token words only: those are always banned)."""
    return max((len(w) for w in words), default=1) - 1 if words else 0


def bad_word_bans(words: tuple[tuple[int, ...], ...], output: list[int] | tuple[int, ...]) -> list[int]:
    """The tokens a row may not take next under vLLM's bad-words rule: a word's last token wherever the
    row's output (token ids, its known tail at least :func:`bad_words_tail` long) ends with the word's other
    tokens; a single-token word is always banned; a word longer than the output plus one is skipped (its
    prefix cannot be there yet)."""
    out = []
    n = len(output)
    for w in words:
        k = len(w) - 1
        if k == 0 or (k <= n and tuple(output[n - k :]) == w[:k]):
            out.append(w[-1])
    return out


def restrict_tokens(logits: torch.Tensor, rows: SamplingMetadata) -> None:
    """Set the logits of the tokens each row may not take to -inf, in place.

    ``logits`` ``[S, V]`` float32 (row i is ``rows`` row i). A row with ``allowed_token_ids`` keeps only
    those tokens; a row with ``bad_words_token_ids`` loses each word's last token where its output ends with
    the word's other tokens (:func:`bad_word_bans`: reads ``rows.output_token_ids``, which the scheduler
    fills with the row's known output tail). Rows without these fields are untouched. The host builds only
    index arrays (one entry per allowed or banned token, never a loop over the vocabulary) and stages them
    in one transfer (:func:`~.staging.to_device`); the masking is two scatters on the device.
    """
    allowed_idx, allow_rows, allow_cols, ban_rows, ban_cols = [], [], [], [], []
    for i, p in enumerate(rows.params):
        if p.allowed_token_ids is not None:
            allow_rows.append(np.full(len(p.allowed_token_ids), len(allowed_idx), dtype=np.int64))
            allow_cols.append(np.asarray(p.allowed_token_ids, dtype=np.int64))
            allowed_idx.append(i)
    na = len(allowed_idx)
    for i, p in enumerate(rows.params):
        if p.bad_words_token_ids:
            out = rows.output_token_ids[i] or ()
            for t in bad_word_bans(p.bad_words_token_ids, out):
                ban_rows.append(i), ban_cols.append(t)
    arrays = []
    if na:
        arrays += [
            np.asarray(allowed_idx, dtype=np.int64),
            np.concatenate(allow_rows),
            np.concatenate(allow_cols),
        ]
    if ban_rows:
        arrays += [np.asarray(ban_rows, dtype=np.int64), np.asarray(ban_cols, dtype=np.int64)]
    if not arrays:
        return
    staged = to_device(arrays, logits.device)
    if na:
        rows_t, local_r, cols = staged[:3]
        staged = staged[3:]
        keep = torch.zeros((na, logits.shape[1]), dtype=torch.bool, device=logits.device)
        keep[local_r, cols] = True
        sub = logits.index_select(0, rows_t)
        logits.index_copy_(0, rows_t, sub.masked_fill_(~keep, float("-inf")))
    if ban_rows:
        r, c = staged
        logits.index_put_((r, c), logits.new_full((), float("-inf")))
