"""Token restrictions applied to a step's float32 logits before the draw: ``allowed_token_ids``, bad words
and structured-output grammar bitmasks (every banned token's logit becomes -inf)."""

from __future__ import annotations

import torch

from ..core.sched.output import SamplingMetadata

__all__ = ["restrict_tokens"]


def restrict_tokens(logits: torch.Tensor, rows: SamplingMetadata) -> None:
    """Set the logits of the tokens each row may not take to -inf, in place (``logits`` ``[S, V]`` float32,
    row i as ``rows`` row i)."""
    if all(p.allowed_token_ids is None and p.bad_words_token_ids is None for p in rows.params):
        return  # structured outputs only: worker/grammar_bitmask.py applies the grammar's mask
    raise NotImplementedError("token restrictions: under construction (issue 39)")
