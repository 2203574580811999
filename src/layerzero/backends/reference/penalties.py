"""Reference logits penalties (repetition, presence, frequency): the oracle for ``lz.apply_penalties``
kernels.

Plain PyTorch: token counts by ``scatter_add_`` into ``[B, V + 1]`` (the last column takes the padding id V
and is dropped), penalties in float32 (float64 for float64 logits), the result in logits' dtype.
"""

from __future__ import annotations

import torch

__all__ = ["apply_penalties", "token_counts"]


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """How often each token id occurs per row: ``ids`` ``[B, L]`` (values in ``[0, V]``, V = padding) ->
    ``[B, V]`` int64 counts (padding not counted; L = 0 gives zeros)."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(1, ids.to(torch.int64), torch.ones(ids.shape, dtype=torch.int64, device=ids.device))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalty: torch.Tensor | None = None,
    presence_penalty: torch.Tensor | None = None,
    frequency_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """Repetition penalty (CTRL, Keskar et al. 2019), then frequency and presence penalties (OpenAI API), in
    vLLM's order (``vllm/model_executor/layers/utils.py: apply_penalties``).

    - repetition, over tokens seen in the prompt *or* the output: ``logit > 0 -> logit / r``, else
      ``logit * r`` (Hugging Face ``RepetitionPenaltyLogitsProcessor``; r = 1 changes nothing);
    - frequency and presence, over output tokens only: ``logit -= frequency * count + presence * (count >
      0)``.

    Args:
        logits: ``[B, V]``, any float dtype.
        prompt_token_ids: ``[B, Lp]`` int64/int32, right-padded with V (ignored); Lp may be 0.
        output_token_ids: ``[B, Lo]`` int64/int32, right-padded with V; Lo may be 0.
        repetition_penalty / presence_penalty / frequency_penalty: ``[B]`` float32 or None (off).

    Counts form (``prompt_token_ids`` bool): ``prompt_token_ids`` a ``[B, V]`` mask of the prompt's tokens and
    ``output_token_ids`` ``[B, V]`` int32/int64 counts of the output's tokens (what ``token_counts`` would
    give); the same result as the ids form.

    Returns:
        A new ``[B, V]`` tensor in logits' dtype.

    Raises:
        Nothing of its own: validation is the ops layer's job (``lz.apply_penalties``).

    >>> apply_penalties(torch.tensor([[2.0, -1.0, 3.0]]), torch.tensor([[0, 3]]), torch.tensor([[1]]),
    ...                 repetition_penalty=torch.tensor([2.0]))
    tensor([[ 1., -2.,  3.]])
    """
    b, v = logits.shape
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt, copy=True)
    counts_form = prompt_token_ids.dtype == torch.bool
    out_counts = output_token_ids if counts_form else token_counts(output_token_ids, v)
    if repetition_penalty is not None:
        in_prompt = prompt_token_ids if counts_form else token_counts(prompt_token_ids, v) > 0
        seen = in_prompt | (out_counts > 0)
        r = repetition_penalty.to(cdt)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if frequency_penalty is not None:
        x = x - frequency_penalty.to(cdt)[:, None] * out_counts.to(cdt)
    if presence_penalty is not None:
        x = x - presence_penalty.to(cdt)[:, None] * (out_counts > 0).to(cdt)
    return x.to(logits.dtype)
