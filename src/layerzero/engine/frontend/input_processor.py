"""Input processing: a request's prompt and parameters checked against the model (vocabulary, context length,
tokenizer) before anything is queued; text prompts tokenized (vLLM's input processor); the result is an
:class:`~layerzero.engine.core.messages.EngineCoreRequest` for the engine core."""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Any

import numpy as np

from ..config import EngineConfig, ModelConfig, resolve_max_model_len
from ..core.messages import EngineCoreRequest
from ..errors import bad_input
from ..sampling_params import SamplingParams
from ..structured import check_request

__all__ = ["InputProcessor", "conversations"]


class InputProcessor:
    """Checks requests for one model: ``tokenizer`` (a transformers tokenizer or None), ``vocab_size`` and
    ``max_model_len`` (tokens). :meth:`from_config` builds it from an :class:`EngineConfig` without loading
    weights (the checkpoint's config.json only)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, max_model_len: int, logits_processors: tuple[type, ...] = ()
    ) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        #: The engine's logits-processor classes: their ``validate_params`` checks each request.
        self.logits_processors = logits_processors
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = eos if isinstance(eos, int) else None

    @classmethod
    def from_config(
        cls, engine_config: EngineConfig, tokenizer: Any, model_config: ModelConfig | None = None
    ) -> InputProcessor:
        """The processor of ``engine_config``'s model: its vocabulary size and resolved ``max_model_len``
        (the option, else the model's ``max_position_embeddings``), read from the checkpoint's config.json
        (``model_config`` when the caller has parsed it already).

        Raises:
            ConfigurationError: an unreadable config.json, a ``max_model_len`` above the model's.
        """
        from ..logits_processors import resolve_processor

        cfg = model_config or ModelConfig.from_pretrained(engine_config.model)
        procs = tuple(resolve_processor(p) for p in engine_config.logits_processors)
        return cls(tokenizer, cfg.vocab_size, resolve_max_model_len(engine_config, cfg), procs)

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenize one request: (prompt text or None, the :class:`EngineCoreRequest`).

        Raises:
            InvalidInputError: see :meth:`validate`.
        """
        text, ids = self.validate(prompt, params, priority)
        params = self.with_bad_words(params)
        t = time.time() if arrival_time is None else arrival_time
        return text, EngineCoreRequest(request_id, ids, params, int(priority), t, self.eos_token_id)

    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a prompt given as text or ids, validated.

        Raises:
            InvalidInputError: empty prompt, ids outside the vocabulary or not ints, text without a tokenizer,
                a prompt longer than ``max_model_len``.
        """
        v = self.vocab_size
        if isinstance(prompt, str):
            text, ids = prompt, self._tokenize(prompt)
            where = "the tokenizer gave token id"
        elif isinstance(prompt, (list, tuple)) or isinstance(prompt, np.ndarray) and prompt.ndim == 1:
            text, ids = None, list(prompt)
            where = "prompt token id"
        else:
            raise bad_input("prompt", "a string or a list of token ids", type(prompt).__name__)
        if ids and all(type(t) is int for t in ids):  # plain ints (JSON, tokenizers): no ABC check per id
            bad = None if 0 <= min(ids) and max(ids) < v else next(t for t in ids if not 0 <= t < v)
        else:
            bad = next(
                (
                    t
                    for t in ids
                    if isinstance(t, (bool, np.bool_))
                    or not isinstance(t, numbers.Integral)
                    or not 0 <= t < v
                ),
                None,
            )
        if bad is not None:
            fix = "The tokenizer does not match the model's vocabulary." if text is not None else None
            raise bad_input(where, f"an int in [0, {v})", repr(bad), fix)
        ids = [int(t) for t in ids]
        if not ids:
            raise bad_input("prompt", "at least one token", "an empty prompt")
        if len(ids) > self.max_model_len:
            raise bad_input(
                "prompt length",
                f"<= max_model_len ({self.max_model_len}) tokens",
                len(ids),
                "Shorten the prompt or raise max_model_len.",
            )
        return text, ids

    def _tokenize(self, prompt: str) -> list[int]:
        """The token ids of a text prompt (typed errors for what no tokenizer can take)."""
        if self.tokenizer is None:
            raise bad_input("prompt", "token ids (this checkpoint has no tokenizer)", "a string")
        if not prompt:
            raise bad_input("prompt", "at least one token", "an empty string")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise bad_input(
                "prompt",
                "valid Unicode text (UTF-8 encodable)",
                f"{exc.reason} at index {exc.start}",
                "Remove lone surrogates.",
            ) from None
        try:
            return list(self.tokenizer(prompt)["input_ids"])
        except Exception as exc:  # the tokenizer's own error types vary by library
            raise bad_input(
                "prompt", "text the tokenizer can encode", f"{type(exc).__name__}: {exc}"
            ) from exc

    def check(self, params: SamplingParams) -> None:
        """Request-level checks of ``params`` that need the model (vocabulary, a tokenizer for stop strings).

        A ``structured_outputs`` constraint is built here by the backend the engine core will use
        (:func:`~layerzero.engine.structured.check_request`: no tokenizer needed, cached), so a schema, regex
        or grammar no backend compiles is refused before anything is queued.

        Raises:
            InvalidInputError: see :meth:`SamplingParams.check_vocab`; stop strings without a tokenizer; a
                structured-output constraint no backend compiles, or with ``min_tokens``; bad words it cannot
                tokenize; parameters a logits processor's ``validate_params`` rejects.
        """
        if not isinstance(params, SamplingParams):
            raise bad_input("sampling_params", "a SamplingParams", type(params).__name__)
        params.check_vocab(self.vocab_size)
        self.with_bad_words(params)  # a word the tokenizer cannot take fails here, before anything is queued
        for proc in self.logits_processors:
            try:
                proc.validate_params(params)
            except ValueError as exc:
                raise bad_input(
                    f"SamplingParams for {proc.__name__}", "parameters it accepts", str(exc)
                ) from exc
        if params.stop_strings and self.tokenizer is None:
            raise bad_input(
                "SamplingParams.stop",
                "no stop strings (this checkpoint has no tokenizer)",
                params.stop_strings,
                "Use stop_token_ids.",
            )
        check_request(params)

    def with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` tokenized into ``bad_words_token_ids`` (vLLM's
        ``update_from_tokenizer``): each word, leading blanks stripped, encoded without special tokens, and
        again with one leading space when that gives another first token but as many tokens (the word inside
        a text); merged after the ids given directly, duplicates dropped. ``params`` itself when it has no bad
        words; otherwise a validated copy (``dataclasses.replace``; calling this again changes nothing).

        Raises:
            InvalidInputError: bad words without a tokenizer; a word the tokenizer encodes to nothing or to
                ids outside the vocabulary.
        """
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise bad_input(
                "SamplingParams.bad_words",
                "no bad words (this checkpoint has no tokenizer)",
                params.bad_words,
                "Use bad_words_token_ids.",
            )
        words = list(params.bad_words_token_ids or ())
        for word in params.bad_words:
            plain = self._encode_plain(word.lstrip())
            if not plain:
                raise bad_input("SamplingParams.bad_words item", "a word the tokenizer encodes", repr(word))
            words.append(plain)
            spaced = self._encode_plain(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        merged = tuple(dict.fromkeys(tuple(w) for w in words))
        if merged == params.bad_words_token_ids:
            return params
        out = dataclasses.replace(params, bad_words_token_ids=merged)
        out.check_vocab(self.vocab_size)
        return out

    def _encode_plain(self, text: str) -> tuple[int, ...]:
        """``text``'s token ids without special tokens (a BOS would make every word start alike)."""
        return tuple(int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def validate(
        self, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> tuple[str | None, list[int]]:
        """Every check of one request, nothing queued: (prompt text or None, token ids).

        Raises:
            InvalidInputError: see :meth:`encode` and :meth:`check`; a non-int priority.
        """
        text_ids = self.encode(prompt)
        self.check(params)
        if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, numbers.Integral):
            raise bad_input(
                "priority", "an int (lower runs first with scheduling_policy='priority')", repr(priority)
            )
        return text_ids


def conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """``messages`` (``LLM.chat``'s: one conversation or a list of them) as a list of conversations, each
    checked to be a non-empty list of ``{"role": str, "content": str | list}`` dicts.

    Raises:
        InvalidInputError: anything else (the message shows the start of what came)."""
    fix = 'Pass [{"role": "user", "content": "..."}] or a list of such lists.'
    if not isinstance(messages, (list, tuple)) or not messages:
        raise bad_input(
            "chat messages", "a conversation or a non-empty list of conversations", repr(messages)[:80], fix
        )
    convs = [messages] if isinstance(messages[0], dict) else list(messages)
    for conv in convs:
        if not isinstance(conv, (list, tuple)) or not conv or not all(map(_is_message, conv)):
            raise bad_input(
                "chat conversation",
                "a non-empty list of {'role': str, 'content': str} dicts",
                repr(conv)[:80],
                fix,
            )
    return [list(c) for c in convs]


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
    )
