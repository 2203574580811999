"""Token restrictions applied to a step's float32 logits before the draw: ``allowed_token_ids``, bad words
and structured-output grammar bitmasks (every banned token's logit becomes -inf)."""

from __future__ import annotations

import torch

from ..core.sched.output import SamplingMetadata

__all__ = ["restrict_tokens"]


def restrict_tokens(logits: torch.Tensor, rows: SamplingMetadata) -> None:
    """Set the logits of the tokens each row may not take to -inf, in place (``logits`` ``[S, V]`` float32,
    row i as ``rows`` row i)."""
    raise NotImplementedError("token restrictions: under construction (issue 39)")
