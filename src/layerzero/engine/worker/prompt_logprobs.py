"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's semantics) on the device: the raw logprob
(the model's log-softmax, before penalties and temperature) of each prompt token given the tokens before it,
and the top-N, at the prompt positions a step computes
(:class:`~layerzero.engine.core.sched.output.PromptLogprobsRows`).

The model runner gathers those positions' final hidden states with the sampled rows' (one gather); here
their logits (the LM head) and logprobs (float32) are computed a slice of rows at a time, so a long prompt
chunk never holds ``[R, V]`` logits at once, and go to the host without blocking;
:meth:`PendingPromptLogprobs.resolve` reads them once the step's tokens are read. Steps without such rows
never come here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..core.sched.output import PromptLogprobsRows
from .staging import to_device

__all__ = ["PendingPromptLogprobs", "launch_prompt_logprobs", "prompt_rows"]

SLICE_ELEMENTS = 1 << 25
"""At most this many logits (128 MiB in float32) are computed and log-softmaxed at once."""


def prompt_rows(num_scheduled_tokens: list[int], sample: list[bool], rows: PromptLogprobsRows) -> np.ndarray:
    """The hidden-state rows whose logits a step with prompt logprobs computes: the sampled rows (each sampled
    chunk's last token, in chunk order, as the step's ``logits_indices``), then each prompt-logprob chunk's
    first ``num_rows`` tokens, in :class:`PromptLogprobsRows` order. int64."""
    cu = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int64)
    np.cumsum(num_scheduled_tokens, out=cu[1:])
    sampled = cu[1:][np.asarray(sample, dtype=bool)] - 1
    prompt = [
        np.arange(cu[c], cu[c] + k, dtype=np.int64) for c, k in zip(rows.chunks, rows.num_rows, strict=True)
    ]
    return np.concatenate([sampled, *prompt])


@dataclass(eq=False)
class PendingPromptLogprobs:
    """A step's prompt logprobs on their way to the host: per row the prompt token's logprob, the top-N
    values and ids (N: the step's largest ``top_n``), an event after the copies (CUDA), and how rows split
    into chunks (``num_rows``, each chunk's ``top_n``, its ``target_ids``)."""

    host: list[torch.Tensor]
    event: torch.cuda.Event | None
    num_rows: list[int]
    top_n: list[int]
    target_ids: list[list[int]]

    def resolve(self) -> list[list[dict[int, float]]]:
        """Per chunk, per row: {token id: raw logprob} of the chunk's top ``top_n`` and its prompt token."""
        if self.event is not None:
            self.event.synchronize()
        picked, top_v, top_i = (t.tolist() for t in self.host)
        out: list[list[dict[int, float]]] = []
        r = 0
        for k, n, targets in zip(self.num_rows, self.top_n, self.target_ids, strict=True):
            chunk = []
            for j in range(k):
                d = dict(zip(top_i[r + j][:n], top_v[r + j][:n], strict=True))
                d[targets[j]] = picked[r + j]
                chunk.append(d)
            out.append(chunk)
            r += k
        return out


@torch.no_grad()
def launch_prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    rows: PromptLogprobsRows,
) -> PendingPromptLogprobs:
    """Enqueue the prompt logprobs of the final hidden states ``hidden`` ``[R, H]`` (R =
    ``sum(rows.num_rows)``, in ``rows``' order; ``compute_logits``: the model's LM head, ``[N, H] -> [N,
    V]``, V = ``vocab_size``) and their copies to the host; returns without waiting."""
    targets = [t for ts in rows.target_ids for t in ts]
    (tgt,) = to_device([np.asarray(targets, dtype=np.int64)], hidden.device)
    n = max(rows.top_n)
    step = max(1, SLICE_ELEMENTS // vocab_size)
    picked, top_v, top_i = [], [], []
    for a in range(0, hidden.shape[0], step):
        lp = torch.log_softmax(compute_logits(hidden[a : a + step]).float(), dim=-1)
        picked.append(lp.gather(1, tgt[a : a + step].unsqueeze(1)).squeeze(1))
        if n:
            v, i = lp.topk(n, dim=-1)
        else:
            v, i = lp[:, :0], lp[:, :0].long()
        top_v.append(v)
        top_i.append(i)
    host = [torch.cat(x).to("cpu", non_blocking=True) for x in (picked, top_v, top_i)]
    event = None
    if hidden.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
    return PendingPromptLogprobs(host, event, list(rows.num_rows), list(rows.top_n), rows.target_ids)
