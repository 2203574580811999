"""One adapter per tokenizer library, behind :func:`layerzero.tokenize` / :func:`layerzero.detokenize`: the
base class and the Hugging Face ones (tokenizers, transformers); tiktoken and sentencepiece are in
``_adapters_tiktoken_sp.py``.

Each adapter wraps one tokenizer object and calls that library's own batch APIs, so ids, offsets and text are
the library's. An adapter never imports its library at module import: the object it wraps was made by that
library, so the library is already imported (``sys.modules``) when an adapter is chosen.

Every adapter has ``key``: the sha256 of what decides its output (vocabulary, merges, normalizer,
pre-tokenizer, post-processor, decoder, special tokens), so content-equal tokenizers share one adapter.
"""

from __future__ import annotations

import abc
import hashlib
import json
from functools import cached_property
from typing import Any, NamedTuple

from layerzero.core.errors import InvalidInputError, expected_got

__all__ = ["Adapter", "Encoding", "TokenizersAdapter", "TransformersAdapter", "digest", "unsupported"]


class Encoding(NamedTuple):
    """One text's tokens, as :func:`layerzero.tokenize` returns them with ``return_offsets=True``.

    ``ids``: token ids. ``offsets``: ``(start, end)`` character offsets into the input text per token (Python
    ``str`` indices, end exclusive; ``(0, 0)`` for tokens added by post-processing such as BOS/EOS).
    ``tokens``: each token's string as the library names it (tiktoken: its bytes decoded as UTF-8 with
    ``errors="replace"``).
    """

    ids: list[int]
    offsets: list[tuple[int, int]]
    tokens: list[str]


def digest(*parts: str | bytes) -> str:
    """sha256 (hex) of ``parts``, each length-prefixed so that no two part lists collide."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode("utf-8", "surrogatepass") if isinstance(p, str) else bytes(p)
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def unsupported(library: str, option: str, fix: str) -> InvalidInputError:
    return InvalidInputError(
        expected_got(
            f"tokenize({option}=True) with a {library} tokenizer",
            f"an option {library} supports",
            f"{option}=True",
            fix,
        )
    )


class Adapter(abc.ABC):
    """One tokenizer of one library. Subclasses set ``library`` and implement the five methods."""

    library = ""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.fp = self.fingerprint(obj)
        self.key = self._key()

    def stale(self) -> bool:
        """Whether the wrapped object gained tokens in place since this adapter hashed it."""
        return self.fingerprint(self.obj) != self.fp

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(library={self.library!r}, vocab_size={self.vocab_size}, "
            f"key={self.key[:12]})"
        )

    @staticmethod
    def fingerprint(obj: Any) -> tuple:
        """A cheap summary of ``obj`` that changes when tokens are added to it in place (the identity cache
        re-hashes the content when it changes)."""
        return ()

    @abc.abstractmethod
    def _key(self) -> str:
        """The content hash (hex sha256) that keys the adapter cache."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Exclusive upper bound of the valid token ids."""

    @abc.abstractmethod
    def encode(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[list[int]]:
        """Token ids of each text (the library's batch call)."""

    @abc.abstractmethod
    def encode_offsets(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[Encoding]:
        """Ids, character offsets and token strings of each text."""

    @abc.abstractmethod
    def decode(self, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """Text of each id sequence (the library's batch decode)."""

    def decode_one(self, ids: list[int], skip_special_tokens: bool) -> str:
        """One sequence (the streaming detokenizer's window); adapters override it when the library has a
        cheaper single-sequence call."""
        return self.decode([ids], skip_special_tokens)[0]


class TokenizersAdapter(Adapter):
    """A ``tokenizers.Tokenizer`` (Hugging Face tokenizers): ``encode_batch`` / ``decode_batch``."""

    library = "tokenizers"

    @staticmethod
    def fingerprint(obj: Any) -> tuple:
        return obj.get_vocab_size(with_added_tokens=True), len(obj.get_added_tokens_decoder())

    def _key(self) -> str:
        # to_str(): model (vocab, merges), normalizer, pre-tokenizer, post-processor, decoder, added tokens
        return digest(self.library, self.obj.to_str(), str(bool(self.obj.encode_special_tokens)))

    @cached_property
    def vocab_size(self) -> int:
        return self.obj.get_vocab_size(with_added_tokens=True)

    def _variant(self, split: bool) -> Any:
        """The tokenizer whose ``encode_special_tokens`` is ``split`` (a copy made once when it differs)."""
        if bool(self.obj.encode_special_tokens) == split:
            return self.obj
        copies = self.__dict__.setdefault("_copies", {})
        if split not in copies:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(self.obj.to_str())
            tok.encode_special_tokens = split
            copies[split] = tok
        return copies[split]

    def encode(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[list[int]]:
        tok = self._variant(split_special_tokens)
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def encode_offsets(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[Encoding]:
        tok = self._variant(split_special_tokens)
        return [
            Encoding(e.ids, list(e.offsets), e.tokens)
            for e in tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        ]

    def decode(self, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return self.obj.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    def decode_one(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.obj.decode(ids, skip_special_tokens=skip_special_tokens)


class TransformersAdapter(Adapter):
    """A transformers ``PreTrainedTokenizerBase`` (fast or slow): ``__call__`` / ``batch_decode``."""

    library = "transformers"

    @staticmethod
    def fingerprint(obj: Any) -> tuple:
        return len(obj), len(obj.added_tokens_decoder)

    def _key(self) -> str:
        tok = self.obj
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            body = backend.to_str()
        else:  # a slow (Python) tokenizer: its vocabulary, and its sentencepiece model when it has one
            sp = getattr(tok, "sp_model", None)
            proto = sp.serialized_model_proto() if sp is not None else b""
            body = json.dumps(tok.get_vocab(), sort_keys=True, ensure_ascii=False) + proto.hex()
        added = sorted(
            (i, str(t), bool(getattr(t, "special", False))) for i, t in tok.added_tokens_decoder.items()
        )
        flags = (
            type(tok).__name__,
            getattr(tok, "clean_up_tokenization_spaces", None),
            getattr(tok, "split_special_tokens", None),
            getattr(tok, "add_bos_token", None),
            getattr(tok, "add_eos_token", None),
            sorted(map(str, tok.all_special_tokens)),
        )
        return digest(self.library, body, repr(added), repr(flags))

    @cached_property
    def vocab_size(self) -> int:
        return len(self.obj)

    def _call(self, texts: list[str], add: bool, split: bool, offsets: bool) -> Any:
        return self.obj(
            texts,
            add_special_tokens=add,
            split_special_tokens=split,
            return_attention_mask=False,
            return_token_type_ids=False,
            return_offsets_mapping=offsets,
        )

    def encode(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[list[int]]:
        return [
            list(x) for x in self._call(texts, add_special_tokens, split_special_tokens, False)["input_ids"]
        ]

    def encode_offsets(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[Encoding]:
        try:
            out = self._call(texts, add_special_tokens, split_special_tokens, True)
        except NotImplementedError as e:
            raise unsupported(
                "slow (Python) transformers",
                "return_offsets",
                "Offsets need a fast tokenizer: load it with use_fast=True "
                "(a PreTrainedTokenizerFast), or pass its tokenizer.json.",
            ) from e
        conv = self.obj.convert_ids_to_tokens
        return [
            Encoding(list(ids), [tuple(o) for o in offs], list(conv(list(ids))))
            for ids, offs in zip(out["input_ids"], out["offset_mapping"], strict=True)
        ]

    def decode(self, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return self.obj.batch_decode(batch, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _direct(self) -> Any:
        """The backend ``tokenizers.Tokenizer`` when transformers' decode is exactly its decode (a fast
        tokenizer that does not override ``_decode``, without ``clean_up_tokenization_spaces``), else None."""
        import transformers

        tok, fast = self.obj, transformers.PreTrainedTokenizerFast
        plain = (
            isinstance(tok, fast)
            and type(tok)._decode is fast._decode
            and not tok.clean_up_tokenization_spaces
        )
        return tok.backend_tokenizer if plain else None

    def decode_one(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._direct is not None:  # the streaming window: 4x cheaper than transformers' decode
            return self._direct.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.obj.decode(ids, skip_special_tokens=skip_special_tokens)
