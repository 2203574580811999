"""``SamplingParams``: how one request is sampled and when it stops (vLLM's names and semantics)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from .errors import bad_input
from .structured_params import StructuredOutputsParams

__all__ = ["MAX_LOGPROBS", "MAX_SEED", "MAX_TOP_K", "SamplingParams", "StructuredOutputsParams"]

MAX_LOGPROBS = 20
"""The most top-N logprobs a request may ask for (OpenAI's and vLLM's default limit)."""


_F32_MAX = float(np.finfo(np.float32).max)
MAX_SEED = 2**63 - 1
"""The largest ``seed`` (the sampler keeps seeds as int64)."""
MAX_TOP_K = 2**31 - 1
"""The largest ``top_k`` (the sampler keeps it as int32; any k >= the vocabulary keeps every token)."""


def _number(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    fix: str | None = None,
) -> float:
    """``value`` as a float that is finite in float32 (the sampler's compute dtype) and inside the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise bad_input(f"SamplingParams.{name}", "a finite number", repr(value), fix)
    value = float(value)
    if lo is not None and (value < lo or (lo_open and value == lo)) or hi is not None and value > hi:
        rng = (
            f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        )
        raise bad_input(f"SamplingParams.{name}", f"a number in {rng}", repr(value), fix)
    if abs(value) > _F32_MAX or (lo_open and lo == 0.0 and float(np.float32(value)) == 0.0):
        raise bad_input(
            f"SamplingParams.{name}",
            "a number representable in float32 (the sampler's dtype: "
            f"magnitude in (1.4e-45, {_F32_MAX:.4g}])",
            repr(value),
            fix,
        )
    return value


def _int(name: str, value: Any, lo: int, fix: str | None = None, hi: int | None = None) -> int:
    """``value`` (an int or a numpy integer, not a bool) as an int in ``[lo, hi]``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < lo
        or hi is not None
        and value > hi
    ):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_input(f"SamplingParams.{name}", f"an int {rng}", repr(value), fix)
    return int(value)


def _check_text(name: str, text: str) -> None:
    """``text`` encodes as UTF-8 (a lone surrogate such as ``"\\ud800"`` does not: no tokenizer can take
    it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_input(
            f"SamplingParams.{name}",
            "valid Unicode text (UTF-8 encodable)",
            f"{text[max(exc.start - 8, 0) : exc.end + 8]!r} with {exc.reason} at index {exc.start}",
            "Remove lone surrogates.",
        ) from None


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping of one request.

    - ``n``: completions per prompt (each an independent sample sharing the prompt's cached KV blocks).
    - ``temperature``: >= 0; 0 is greedy (argmax). ``top_k``: 0 or -1 = off, else keep the k most likely
      tokens (k <= 2**31 - 1). ``top_p``: in (0, 1], 1 = off (nucleus, Holtzman et al. 2019). ``min_p``: in
      [0, 1], 0 = off (keep tokens with probability >= min_p x the top one). Order: temperature, top-k, top-p,
      min-p (transformers' warpers).
    - ``repetition_penalty`` > 0 (1 = off; CTRL, over prompt and output tokens), ``presence_penalty`` and
      ``frequency_penalty`` in [-2, 2] (0 = off; OpenAI's, over output tokens). ``logit_bias``: {token id:
      bias added to the logit}, bias in [-100, 100].
    - ``stop``: strings that end the output (they may span tokens; not included in the returned text);
      ``stop_token_ids``: token ids that end it (kept in ``token_ids``, not in the text); ``ignore_eos``: do
      not stop at the model's EOS tokens. ``max_tokens`` >= 1 tokens at most; ``min_tokens``: no stop (EOS,
      stop ids, stop strings) before that many tokens. ``finish_reason`` is ``"stop"`` or ``"length"``
      (``"abort"`` for an aborted request, ``"error"`` for one that failed inside a step; docs/engine.md).
    - ``seed``: in [0, 2**63): the request's own random stream: the same tokens whether it runs alone or in
      any batch.
    - ``logprobs``: None, or N in [0, 20]: the top-N log-probabilities of each generated token plus the chosen
      one's, from the model's log-softmax before penalties, bias, temperature and filters (vLLM's raw
      logprobs).
    - ``prompt_logprobs``: None, or N in [0, 20]: for every prompt token after the first, its raw logprob
      given the tokens before it plus the top-N at that position (``RequestOutput.prompt_logprobs``: one
      entry per prompt token, the first None; sent with the request's first output). Such a request
      recomputes its prompt (no prefix-cache hits: cached tokens have no logits), as vLLM does.
    - ``skip_special_tokens``: leave special tokens out of the text (as tokenizers' ``decode`` does).
    - ``allowed_token_ids``: only these tokens may be generated (every other logit is -inf); ``bad_words``:
      words never generated (each tokenized by the front end with and without a leading space into
      ``bad_words_token_ids``: a word's last token is banned where the output ends with its other tokens,
      vLLM's rule); ``bad_words_token_ids`` may also be given directly.
    - ``structured_outputs``: a :class:`StructuredOutputsParams` (or its dict): the output follows a JSON
      schema, a regex, a choice or a grammar (docs/decoding.md).
    - ``extra_args``: free-form per-request arguments for logits-processor plugins (vLLM v1's
      ``extra_args``): plain data (msgpack-able).

    Every float must also be representable in float32, the sampler's dtype (``temperature=1e39`` is finite in
    Python and ``inf`` there). Ints may be Python or numpy integers; they are stored as Python ints, lists as
    tuples and ``logit_bias`` as a read-only mapping. The object is frozen: a field cannot change after it was
    validated (``dataclasses.replace(params, temperature=0.0)`` makes a validated variant). Token ids are
    checked against the vocabulary when the request is added (the engine knows its size).

    Raises:
        InvalidInputError: a value of the wrong type, not finite or out of range (the message gives the
            range).
        dataclasses.FrozenInstanceError: assigning a field after construction.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: str | Sequence[str] | None = None
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None
    extra_args: Mapping[str, Any] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        put = (
            object.__setattr__
        )  # frozen: each field is set once, here, to its validated (plain Python) value
        put(self, "n", _int("n", self.n, 1))
        put(
            self,
            "temperature",
            _number("temperature", self.temperature, 0.0, fix="Use 0 for greedy decoding."),
        )
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, numbers.Integral)
            or not -1 <= self.top_k <= MAX_TOP_K
        ):
            raise bad_input(
                "SamplingParams.top_k", f"an int in [1, {MAX_TOP_K}], or 0 / -1 for no cut", repr(self.top_k)
            )
        put(self, "top_k", int(self.top_k))
        put(
            self,
            "top_p",
            _number("top_p", self.top_p, 0.0, 1.0, lo_open=True, fix="Use 1.0 for no nucleus cut."),
        )
        put(self, "min_p", _number("min_p", self.min_p, 0.0, 1.0))
        put(
            self,
            "repetition_penalty",
            _number(
                "repetition_penalty",
                self.repetition_penalty,
                0.0,
                lo_open=True,
                fix="Use 1.0 for no penalty.",
            ),
        )
        put(self, "presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        put(self, "frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise bad_input(
                    "SamplingParams.logit_bias",
                    "a dict {token id: bias} or None",
                    type(self.logit_bias).__name__,
                )
            put(
                self,
                "logit_bias",
                MappingProxyType(
                    {
                        _int("logit_bias key", k, 0): _number("logit_bias value", v, -100.0, 100.0)
                        for k, v in self.logit_bias.items()
                    }
                ),
            )
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (
            not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop)
        ):
            raise bad_input(
                "SamplingParams.stop", "a non-empty string, a list of them, or None", repr(self.stop)
            )
        for s in stop or ():
            _check_text("stop", s)
        put(self, "stop", None if stop is None else tuple(stop))
        put(self, "stop_strings", tuple(stop or ()))
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple, np.ndarray)):
                raise bad_input(
                    "SamplingParams.stop_token_ids",
                    "a list of token ids or None",
                    type(self.stop_token_ids).__name__,
                )
            put(self, "stop_token_ids", tuple(_int("stop_token_ids item", t, 0) for t in self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise bad_input(f"SamplingParams.{name}", "a bool", repr(getattr(self, name)))
            put(self, name, bool(getattr(self, name)))
        put(self, "max_tokens", _int("max_tokens", self.max_tokens, 1, "Ask for at least one token."))
        put(self, "min_tokens", _int("min_tokens", self.min_tokens, 0))
        if self.min_tokens > self.max_tokens:
            raise bad_input(
                "SamplingParams.min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens
            )
        if self.seed is not None:
            put(self, "seed", _int("seed", self.seed, 0, "Seeds are int64: use a smaller seed.", hi=MAX_SEED))
        if self.logprobs is not None:
            put(self, "logprobs", _int("logprobs", self.logprobs, 0, hi=MAX_LOGPROBS))
        if self.prompt_logprobs is not None:
            put(
                self,
                "prompt_logprobs",
                _int(
                    "prompt_logprobs",
                    self.prompt_logprobs,
                    0,
                    "Use None for no prompt logprobs, 0 for only each prompt token's own.",
                    hi=MAX_LOGPROBS,
                ),
            )

        self._check_new_fields(put)

    def _check_new_fields(self, put: Any) -> None:
        """Validate the token-restriction, structured-output and plugin fields."""
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (
                isinstance(ids, (str, bytes))
                or not isinstance(ids, (list, tuple, np.ndarray))
                or not len(ids)
            ):
                raise bad_input(
                    "SamplingParams.allowed_token_ids",
                    "a non-empty list of token ids or None",
                    repr(ids),
                    "Use None to allow every token.",
                )
            put(self, "allowed_token_ids", tuple(_int("allowed_token_ids item", t, 0) for t in ids))
        words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in words
            ):
                raise bad_input(
                    "SamplingParams.bad_words", "a list of non-blank strings or None", repr(self.bad_words)
                )
            for w in words:
                _check_text("bad_words", w)
            put(self, "bad_words", tuple(words))
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            if not isinstance(seqs, (list, tuple)) or not all(
                isinstance(w, (list, tuple)) and len(w) for w in seqs
            ):
                raise bad_input(
                    "SamplingParams.bad_words_token_ids",
                    "a list of non-empty token-id lists or None",
                    repr(seqs),
                )
            put(
                self,
                "bad_words_token_ids",
                tuple(tuple(_int("bad_words_token_ids item", t, 0) for t in w) for w in seqs),
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            if not isinstance(so, Mapping):
                raise bad_input(
                    "SamplingParams.structured_outputs",
                    "a StructuredOutputsParams, its dict, or None",
                    type(so).__name__,
                )
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as exc:
                raise bad_input(
                    "SamplingParams.structured_outputs", "StructuredOutputsParams' fields", str(exc)
                ) from None
            put(self, "structured_outputs", so)
        if self.extra_args is not None:
            if not isinstance(self.extra_args, Mapping) or not all(
                isinstance(k, str) for k in self.extra_args
            ):
                raise bad_input(
                    "SamplingParams.extra_args", "a dict with string keys or None", repr(self.extra_args)
                )
            put(self, "extra_args", MappingProxyType(dict(self.extra_args)))

    @property
    def restricted(self) -> bool:
        """Whether the request limits which tokens may come next: ``allowed_token_ids``, bad words or a
        structured-output constraint (the sampler masks its row)."""
        return (
            self.allowed_token_ids is not None
            or self.bad_words_token_ids is not None
            or self.structured_outputs is not None
        )

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax decoding (top-k/top-p/min-p and the seed do not matter)."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Any of the repetition / presence / frequency penalties on (they read the tokens generated so
        far)."""
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
        for name, ids in (
            ("logit_bias", self.logit_bias or {}),
            ("stop_token_ids", self.stop_token_ids or []),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words_token_ids", [t for w in self.bad_words_token_ids or () for t in w]),
        ):
            for t in ids:
                if t >= vocab_size:
                    raise bad_input(f"SamplingParams.{name} token id", f"< vocab size {vocab_size}", t)
