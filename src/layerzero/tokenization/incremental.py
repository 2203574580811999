"""Incremental (streaming) detokenization: text grows one token at a time, and only complete text comes out.

The algorithm is vLLM's ``detokenize_incrementally`` (and tokenizers' ``DecodeStream``, transformers'
``TextStreamer``): keep two offsets into the token ids, ``prefix`` <= ``read``. Each step decodes the window
``ids[prefix:read]`` (text already emitted, kept as context) and ``ids[prefix:]``; the new text is what the
second adds to the first. It is held back while it ends in U+FFFD (a UTF-8 character split over byte-level
BPE or byte-fallback tokens is not complete yet) or adds nothing; once emitted, ``prefix`` moves to ``read``
and ``read`` to the end. Decoding a window rather than single tokens keeps what depends on neighbours right:
sentencepiece / Metaspace "▁" spaces (the first piece of a decode loses its space, in both windows alike),
WordPiece "##" continuations, byte-level merges across tokens. When the context window decodes to nothing
(all "▁" spaces, which sentencepiece strips at the start of a decode, or skipped special tokens), ``prefix``
moves back a few tokens so that the spaces in it count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._cache import resolve
from ._validate import check_id, check_ids_fit, id_lists

__all__ = ["IncrementalDetokenizer"]

REPLACEMENT = "\ufffd"
MAX_BACKOFF = 8
"""Tokens ``prefix`` may move back when the context window decodes to nothing."""


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas, emitting only complete text.

    Args:
        tokenizer: any tokenizer :func:`layerzero.tokenize` accepts (object or path; cached the same way).
        prompt_ids: ids that come before the stream (a prompt). Its last ``context_tokens`` ids prime the
            decoder, so the first streamed token decodes as it does after the prompt (its leading space in
            sentencepiece / Metaspace tokenizers); they are never emitted. A context tail that ends in an
            incomplete character is left out.
        skip_special_tokens: leave special tokens out of the text (as ``detokenize`` does).
        context_tokens: how many prompt ids prime the decoder (vLLM: 5); 0 for none.

    Use :meth:`step` (or :meth:`extend`) per new token and :meth:`flush` at the end of the stream:
    without a prompt, ``"".join(deltas) + flush()`` equals ``detokenize(all_ids, tokenizer)`` for
    tokenizers whose decode of a longer window starts with the decode of a shorter one (byte-level BPE,
    sentencepiece, WordPiece, Metaspace). No delta ends in U+FFFD until :meth:`flush`.

    Raises:
        InvalidInputError: an unsupported tokenizer; ids that are not ints or outside the vocabulary
            (at construction for ``prompt_ids``, in :meth:`step` / :meth:`extend` for new ids).

    >>> d = IncrementalDetokenizer(tok)                          # doctest: +SKIP
    >>> "".join(d.step(t) for t in ids) + d.flush() == lz.detokenize(ids, tok)  # doctest: +SKIP
    True
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = False,
        context_tokens: int = 5,
    ) -> None:
        self._adapter = resolve(tokenizer)
        self._skip = bool(skip_special_tokens)
        if not isinstance(context_tokens, int) or isinstance(context_tokens, bool) or context_tokens < 0:
            from layerzero.core.errors import InvalidInputError, expected_got

            raise InvalidInputError(
                expected_got("IncrementalDetokenizer(context_tokens)", "an int >= 0", repr(context_tokens))
            )
        ctx: list[int] = []
        if context_tokens and len(prompt_ids):
            (prompt,), _ = id_lists(prompt_ids, "IncrementalDetokenizer(prompt_ids)", single_only=True)
            check_ids_fit("IncrementalDetokenizer(prompt_ids)", [prompt], self._adapter.vocab_size)
            ctx = prompt[-context_tokens:]
            while ctx and self._decode(ctx).endswith(REPLACEMENT):
                ctx.pop()
        self._ids: list[int] = ctx
        self._start = self._read = len(ctx)
        self._prefix = 0  # the context window ids[prefix:read] is the prompt tail
        self._prefix_text: str | None = None
        self._chunks: list[str] = []
        self._text: str | None = ""

    @property
    def vocab_size(self) -> int:
        """Exclusive upper bound of the token ids this tokenizer decodes."""
        return self._adapter.vocab_size

    @property
    def token_ids(self) -> list[int]:
        """The streamed ids so far (the prompt context left out)."""
        return self._ids[self._start :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas)."""
        if self._text is None:
            self._text = "".join(self._chunks)
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self._adapter.decode_one(ids, self._skip)

    def step(self, token_id: int) -> str:
        """Add one token id; return the text it completes ("" while the text is held back)."""
        self._ids.append(
            check_id(token_id, self._adapter.vocab_size, "IncrementalDetokenizer.step(token_id)")
        )
        return self._advance()

    def extend(self, token_ids: Sequence[int]) -> str:
        """Add several token ids at once (e.g. accepted speculative tokens); return the text they complete."""
        (ids,), _ = id_lists(token_ids, "IncrementalDetokenizer.extend(token_ids)", single_only=True)
        check_ids_fit("IncrementalDetokenizer.extend(token_ids)", [ids], self._adapter.vocab_size)
        self._ids.extend(ids)
        return self._advance() if ids else ""

    def flush(self) -> str:
        """End of stream: return the held-back tail too (it may end in U+FFFD: an incomplete character)."""
        return self._advance(final=True)

    def _context(self) -> str:
        if self._prefix_text is None:
            back = 0
            text = self._decode(self._ids[self._prefix : self._read])
            while not text and self._prefix > 0 and back < MAX_BACKOFF:
                self._prefix -= 1
                back += 1
                text = self._decode(self._ids[self._prefix : self._read])
            self._prefix_text = text
        return self._prefix_text

    def _advance(self, final: bool = False) -> str:
        if len(self._ids) == self._read:
            return ""
        before = self._context()
        new = self._decode(self._ids[self._prefix :])
        if len(new) <= len(before) or (new.endswith(REPLACEMENT) and not final):
            return ""
        delta = new[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        self._chunks.append(delta)
        self._text = None
        return delta
