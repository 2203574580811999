"""Incremental detokenization and stop strings.

Text grows one token at a time through :class:`layerzero.IncrementalDetokenizer` (prefix/read offsets over a
window of ids; text ending in an incomplete UTF-8 character is held back), primed with the last prompt tokens
so the first output token decodes with its leading space as in the full text (vLLM does the same with 5
tokens of context). Stop strings may span tokens: after each token the tail of the text is searched; the text
is cut before the first stop string found. While a request streams, text that could still be the start of a
stop string is held back, so no yielded delta is ever taken back.
"""

from __future__ import annotations

from typing import Any

import layerzero as lz

__all__ = ["CONTEXT_TOKENS", "Detokenizer"]

CONTEXT_TOKENS = 5
"""Prompt tokens that prime the stream (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)."""


class Detokenizer:
    """One sequence's text. ``tokenizer``: any tokenizer ``lz.IncrementalDetokenizer`` accepts (the engine
    passes the checkpoint's transformers tokenizer)."""

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...], skip_special_tokens: bool
    ):
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.text = ""
        self.emitted = 0
        self._stream = lz.IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.vocab = self._stream.vocab_size  # a model's vocabulary may be larger than its tokenizer's
        ctx = [t for t in prompt_ids[-CONTEXT_TOKENS:] if t < self.vocab]
        self._stream = lz.IncrementalDetokenizer(
            tokenizer, ctx, skip_special_tokens=skip_special_tokens, context_tokens=CONTEXT_TOKENS
        )

    def add(self, token_id: int, check_stop: bool) -> str | None:
        """Append a token's text; return the stop string found (the text is then cut before it), else None.
        ``check_stop`` False (before ``min_tokens``) skips the search."""
        before = len(self.text)
        if token_id < self.vocab:  # an id past the tokenizer's vocabulary has no text (as tokenizers' decode)
            self.text += self._stream.step(token_id)
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
        piece, self.emitted = self.text[self.emitted : end], end
        return piece
