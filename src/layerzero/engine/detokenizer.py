"""Incremental detokenization and stop strings.

Text grows one token at a time through ``tokenizers``' ``DecodeStream`` (it buffers incomplete UTF-8 and byte-
fallback pieces), primed with the last prompt tokens so the first output token decodes with its leading space as
in the full text (vLLM does the same with 5 tokens of context). Stop strings may span tokens: after each token
the tail of the text is searched; the text is cut before the first stop string found. While a request streams,
text that could still be the start of a stop string is held back, so no yielded delta is ever taken back.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONTEXT_TOKENS", "Detokenizer"]

CONTEXT_TOKENS = 5
"""Prompt tokens that prime the stream (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)."""


class Detokenizer:
    """One sequence's text. ``tokenizer``: a transformers tokenizer (fast: its ``backend_tokenizer`` is used;
    otherwise the whole output is decoded again each step, correct but O(n) per token)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...], skip_special_tokens: bool):
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.text = ""
        self.emitted = 0
        self.output_ids: list[int] = []
        self._stream = None
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=list(prompt_ids[-CONTEXT_TOKENS:]), skip_special_tokens=self.skip)

    def add(self, token_id: int, check_stop: bool) -> str | None:
        """Append a token's text; return the stop string found (the text is then cut before it), else None.
        ``check_stop`` False (before ``min_tokens``) skips the search."""
        self.output_ids.append(token_id)
        before = len(self.text)
        if self._stream is not None:
            self.text += self._stream.step(self.backend, token_id) or ""
        else:
            self.text = self.tokenizer.decode(self.output_ids, skip_special_tokens=self.skip)
        if not check_stop or not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        at, s = min(found)
        self.text = self.text[:at]
        return s

    def visible(self, finished: bool) -> int:
        """How much of the text may be shown: all of it once finished, else all but a tail that is a proper
        prefix of a stop string (it may still become one)."""
        if finished or not self.stop:
            return len(self.text)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return len(self.text) - hold

    def delta(self, finished: bool) -> str:
        """The visible text not returned by an earlier call."""
        end = max(self.visible(finished), self.emitted)
        piece, self.emitted = self.text[self.emitted:end], end
        return piece
