"""Speculative decoding's host side (:class:`SpecDecodeState`): which sequences speculate this step and how
many drafts they get (n-gram drafts proposed here; a draft model's in the worker), why a sequence does not
(logged once per reason and counted), and the acceptance counters (engine-wide and per sequence)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ..sampling_params import SamplingParams
from .config import SpeculativeConfig
from .ngram import ngram_propose

__all__ = ["SpecDecodeState", "unsupported_reason"]

log = logging.getLogger("layerzero.engine")


def unsupported_reason(p: SamplingParams) -> str | None:
    """Why a request with ``p`` decodes without speculation (its rows are verified by plain sampling), or None
    when the verifier implements everything it asks for (greedy, temperature, top-k, top-p, min-p, seeds,
    stops, ``max_tokens``, ``ignore_eos``, ``logprobs``, ``logit_bias``, ``min_tokens``). Refused: penalties
    (they depend on the tokens before each verified position) and token restrictions (``allowed_token_ids``,
    bad words, structured outputs: applied by the plain sampler only)."""
    if p.penalized:
        return "penalties"
    if p.restricted:
        return "allowed_token_ids / bad_words / structured_outputs"
    return None


class SpecDecodeState:
    """The engine core's speculative-decoding state for ``cfg`` (:class:`SpeculativeConfig`).

    Counters (vLLM's ``spec_decode`` metrics): ``num_drafts`` (verification rows: a sequence's step with at
    least one draft), ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_pos[j]`` (rows whose draft
    j was accepted), ``skipped`` (sequence steps decoded without speculation, per reason)."""

    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.cfg, self.max_model_len = cfg, max_model_len
        self.k = cfg.num_speculative_tokens
        self.host_drafts = cfg.method == "ngram"
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.skipped: Counter[str] = Counter()
        self._logged: set[str] = set()

    def eligible(self, p: SamplingParams) -> bool:
        """Whether sequences with ``p`` speculate (when their step allows it)."""
        return unsupported_reason(p) is None

    def drafts(self, seq: Any, budget: int) -> list[int] | None:
        """The drafts ``seq`` (a decoding :class:`~layerzero.engine.core.sequence.Sequence`, its last token
        known) verifies this step: n-gram drafts, or ``[-1] * k`` (a draft model's, proposed by the worker);
        None when it decodes one token (unsupported parameters: logged once per reason and counted; no room
        before ``max_tokens`` / ``max_model_len`` / the step's token ``budget``; no n-gram match)."""
        p = seq.params
        why = unsupported_reason(p)
        if why is not None:
            self.skipped[why] += 1
            if why not in self._logged:
                self._logged.add(why)
                log.info("speculative decoding: sequences with %s decode without speculation", why)
            return None
        k = min(
            self.k,
            p.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
            budget - 1,
        )
        if k < 1:
            return None
        if not self.host_drafts:
            return [-1] * k
        c = self.cfg
        d = ngram_propose(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
        return d or None

    def record(self, seq: Any, num_drafts: int, num_accepted: int) -> None:
        """Count one verified row of ``seq``: ``num_drafts`` drafts, ``num_accepted`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted
        seq.num_spec_steps += 1

    def as_dict(self) -> dict[str, Any]:
        """The counters as plain data, with ``acceptance_rate`` (accepted / draft tokens) and
        ``mean_acceptance_length`` (1 + accepted / verification rows: tokens per speculating step)."""
        return {
            "method": self.cfg.method,
            "num_speculative_tokens": self.k,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens
            else 0.0,
            "mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts
            if self.num_drafts
            else 0.0,
            "skipped": dict(self.skipped),
        }
