"""Tokenization over the tokenizer libraries people already use: ``lz.tokenize``, ``lz.detokenize`` and
``lz.IncrementalDetokenizer`` (streaming). See docs/tokenization.md.

Supported tokenizers: ``tokenizers.Tokenizer`` (Hugging Face tokenizers), transformers'
``PreTrainedTokenizerBase`` (fast or slow), ``tiktoken.Encoding``, ``sentencepiece.SentencePieceProcessor``,
or a path to a ``tokenizer.json`` / ``tokenizer.model`` (or a directory holding one). Ids, offsets and text
are the library's own: each call goes to that library's batch API. None of these libraries is imported by
``import layerzero``; a tokenizer object brings its library along.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

from ._adapters import Encoding
from ._cache import cache_info, clear_cache, resolve
from ._validate import check_ids_fit, id_lists, text_list
from .incremental import IncrementalDetokenizer

__all__ = ["Encoding", "IncrementalDetokenizer", "cache_info", "clear_cache", "detokenize", "tokenize"]


@overload
def tokenize(
    texts: str,
    tokenizer: Any,
    *,
    add_special_tokens: bool = ...,
    return_offsets: Literal[False] = ...,
    split_special_tokens: bool = ...,
) -> list[int]: ...
@overload
def tokenize(
    texts: str,
    tokenizer: Any,
    *,
    add_special_tokens: bool = ...,
    return_offsets: Literal[True],
    split_special_tokens: bool = ...,
) -> Encoding: ...
@overload
def tokenize(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    add_special_tokens: bool = ...,
    return_offsets: Literal[False] = ...,
    split_special_tokens: bool = ...,
) -> list[list[int]]: ...
@overload
def tokenize(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    add_special_tokens: bool = ...,
    return_offsets: Literal[True],
    split_special_tokens: bool = ...,
) -> list[Encoding]: ...


def tokenize(
    texts: str | Sequence[str],
    tokenizer: Any,
    *,
    add_special_tokens: bool = True,
    return_offsets: bool = False,
    split_special_tokens: bool = False,
) -> list[int] | Encoding | list[list[int]] | list[Encoding]:
    """Token ids of ``texts``, exactly as ``tokenizer``'s own library encodes them.

    Args:
        texts: one ``str`` (returns one result) or a list/tuple of ``str`` (returns a list, in order; encoded
            with the library's batch API: ``encode_batch``, ``encode_ordinary_batch``, ``encode(list)``).
        tokenizer: a ``tokenizers.Tokenizer``, a transformers ``PreTrainedTokenizerBase``, a
            ``tiktoken.Encoding``, a ``sentencepiece.SentencePieceProcessor``, or a path (``str`` /
            ``PathLike``) to a ``tokenizer.json`` / ``tokenizer.model`` or a directory with one (loaded once).
            Adapters are cached by a sha256 of the tokenizer's content (see docs/tokenization.md).
        add_special_tokens: add what the tokenizer's post-processing adds (BOS/EOS, CLS/SEP): tokenizers'
            and transformers' ``add_special_tokens``; sentencepiece: the processor's own ``add_bos`` /
            ``add_eos`` when True, neither when False; tiktoken adds nothing either way.
        return_offsets: return :class:`Encoding` (``ids``, ``offsets``: ``(start, end)`` character offsets
            into the text, ``tokens``) instead of id lists. transformers needs a fast tokenizer for it.
        split_special_tokens: special-token text inside the input (``"<|endoftext|>"``) is encoded as plain
            text instead of as the special token (tokenizers ``encode_special_tokens``, transformers
            ``split_special_tokens``, tiktoken ``encode_ordinary``; sentencepiece: not supported).

    Returns:
        ``list[int]`` for one text, ``list[list[int]]`` for a list; :class:`Encoding` / ``list[Encoding]``
        with ``return_offsets=True``.

    Raises:
        InvalidInputError: ``texts`` not a str or a list of str; an unsupported tokenizer object or path; an
            option the library cannot honour (offsets of a slow transformers tokenizer, sentencepiece with
            ``split_special_tokens``).

    >>> lz.tokenize("Hello world", tok)                           # doctest: +SKIP
    [15496, 995]
    """
    batch, single = text_list(texts, "tokenize(texts)")
    adapter = resolve(tokenizer)
    add, split = bool(add_special_tokens), bool(split_special_tokens)
    if not batch:
        return []
    out = adapter.encode_offsets(batch, add, split) if return_offsets else adapter.encode(batch, add, split)
    return out[0] if single else out


@overload
def detokenize(ids: Sequence[int], tokenizer: Any, *, skip_special_tokens: bool = ...) -> str: ...
@overload
def detokenize(
    ids: Sequence[Sequence[int]], tokenizer: Any, *, skip_special_tokens: bool = ...
) -> list[str]: ...


def detokenize(ids: Any, tokenizer: Any, *, skip_special_tokens: bool = False) -> str | list[str]:
    """Text of token ids, exactly as ``tokenizer``'s own library decodes them.

    Args:
        ids: one sequence (a list/tuple of ints, or a 1-D tensor/array; returns one ``str``; ``[]`` gives
            ``""``) or a batch (a list of sequences or a 2-D tensor/array; returns ``list[str]``, decoded with
            the library's batch API: ``decode_batch``, ``batch_decode``, ``decode(list)``).
        tokenizer: as :func:`tokenize`.
        skip_special_tokens: leave special tokens out: tokenizers / transformers ``skip_special_tokens``;
            tiktoken: its special tokens; sentencepiece: control and unknown symbols.

    Returns:
        ``str`` for one sequence, ``list[str]`` for a batch. An incomplete UTF-8 character (byte-level
        tokens cut mid-character) decodes as U+FFFD, as the library does.

    Raises:
        InvalidInputError: ids that are not ints (``bool`` included) or outside ``[0, vocab_size)``; an
            unsupported tokenizer; ids the library cannot decode (a gap in a tiktoken vocabulary).

    >>> lz.detokenize([15496, 995], tok)                         # doctest: +SKIP
    'Hello world'
    """
    adapter = resolve(tokenizer)
    batch, single = id_lists(ids, "detokenize(ids)")
    check_ids_fit("detokenize(ids)", batch, adapter.vocab_size)
    out = adapter.decode(batch, bool(skip_special_tokens))
    return out[0] if single else out
