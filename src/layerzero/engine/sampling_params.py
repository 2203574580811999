"""``SamplingParams``: how one request is sampled and when it stops (vLLM's names and semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_input

__all__ = ["MAX_LOGPROBS", "SamplingParams"]

MAX_LOGPROBS = 20
"""The most top-N logprobs a request may ask for (OpenAI's and vLLM's default limit)."""


def _number(name: str, value: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
            fix: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_input(f"SamplingParams.{name}", "a finite number", repr(value), fix)
    if lo is not None and (value < lo or (lo_open and value == lo)) or hi is not None and value > hi:
        rng = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad_input(f"SamplingParams.{name}", f"a number in {rng}", repr(value), fix)
    return float(value)


def _int(name: str, value: Any, lo: int, fix: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise bad_input(f"SamplingParams.{name}", f"an int >= {lo}", repr(value), fix)
    return value


@dataclass
class SamplingParams:
    """Sampling and stopping of one request.

    - ``n``: completions per prompt (each an independent sample sharing the prompt's cached KV blocks).
    - ``temperature``: >= 0; 0 is greedy (argmax). ``top_k``: 0 or -1 = off, else keep the k most likely tokens.
      ``top_p``: in (0, 1], 1 = off (nucleus, Holtzman et al. 2019). ``min_p``: in [0, 1], 0 = off (keep tokens
      with probability >= min_p x the top one). Order: temperature, top-k, top-p, min-p (transformers' warpers).
    - ``repetition_penalty`` > 0 (1 = off; CTRL, over prompt and output tokens), ``presence_penalty`` and
      ``frequency_penalty`` in [-2, 2] (0 = off; OpenAI's, over output tokens). ``logit_bias``: {token id: bias
      added to the logit}, bias in [-100, 100].
    - ``stop``: strings that end the output (they may span tokens; not included in the returned text);
      ``stop_token_ids``: token ids that end it (kept in ``token_ids``, not in the text); ``ignore_eos``: do not
      stop at the model's EOS tokens. ``max_tokens`` >= 1 tokens at most; ``min_tokens``: no stop (EOS, stop
      ids, stop strings) before that many tokens. ``finish_reason`` is ``"stop"`` or ``"length"``.
    - ``seed``: the request's own random stream: the same tokens whether it runs alone or in any batch.
    - ``logprobs``: None, or N in [0, 20]: the top-N log-probabilities of each generated token plus the chosen
      one's, from the model's log-softmax before penalties, bias, temperature and filters (vLLM's raw logprobs).
    - ``skip_special_tokens``: leave special tokens out of the text (as tokenizers' ``decode`` does).

    Token ids are checked against the vocabulary when the request is added (the engine knows its size).

    Raises:
        InvalidInputError: a value of the wrong type, not finite or out of range (the message gives the range).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        _int("n", self.n, 1)
        self.temperature = _number("temperature", self.temperature, 0.0, fix="Use 0 for greedy decoding.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad_input("SamplingParams.top_k", "an int >= 1, or 0 / -1 for no cut", repr(self.top_k))
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, lo_open=True, fix="Use 1.0 for no nucleus cut.")
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True,
                                          fix="Use 1.0 for no penalty.")
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad_input("SamplingParams.logit_bias", "a dict {token id: bias} or None",
                                type(self.logit_bias).__name__)
            self.logit_bias = {_int("logit_bias key", k, 0): _number("logit_bias value", v, -100.0, 100.0)
                               for k, v in self.logit_bias.items()}
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop)):
            raise bad_input("SamplingParams.stop", "a non-empty string, a list of them, or None", repr(self.stop))
        self.stop_strings = tuple(stop or ())
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise bad_input("SamplingParams.stop_token_ids", "a list of token ids or None",
                                type(self.stop_token_ids).__name__)
            self.stop_token_ids = [_int("stop_token_ids item", t, 0) for t in self.stop_token_ids]
        if not isinstance(self.ignore_eos, bool):
            raise bad_input("SamplingParams.ignore_eos", "a bool", repr(self.ignore_eos))
        _int("max_tokens", self.max_tokens, 1, "Ask for at least one token.")
        _int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise bad_input("SamplingParams.min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.seed is not None:
            _int("seed", self.seed, 0)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad_input("SamplingParams.logprobs", f"None or an int in [0, {MAX_LOGPROBS}]", repr(self.logprobs))

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax decoding (top-k/top-p/min-p and the seed do not matter)."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Any of the repetition / presence / frequency penalties on (they read the tokens generated so far)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def top_k_or_off(self) -> int:
        """``top_k`` with both "off" spellings (0 and -1) as 0."""
        return max(self.top_k, 0)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids (``logit_bias`` keys, ``stop_token_ids``) inside ``[0, vocab_size)``.

        Raises:
            InvalidInputError: the first id outside the vocabulary.
        """
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids or [])):
            for t in ids:
                if t >= vocab_size:
                    raise bad_input(f"SamplingParams.{name} token id", f"< vocab size {vocab_size}", t)
