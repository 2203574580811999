"""The tiktoken and sentencepiece adapters (see ``_adapters.py`` for the interface)."""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

from layerzero.core.errors import InvalidInputError, expected_got

from ._adapters import Adapter, Encoding, digest, unsupported

__all__ = ["SentencePieceAdapter", "TiktokenAdapter"]


class TiktokenAdapter(Adapter):
    """A ``tiktoken.Encoding``: ``encode_batch`` / ``encode_ordinary_batch`` / ``decode_batch``.

    tiktoken adds no BOS/EOS, so ``add_special_tokens`` changes nothing. Special-token text in the input is
    encoded as the special token (``allowed_special="all"``) unless ``split_special_tokens`` (then
    ``encode_ordinary``: encoded as plain text).
    """

    library = "tiktoken"

    def _key(self) -> str:
        enc = self.obj
        ranks = getattr(enc, "_mergeable_ranks", None)
        if ranks is None:  # not a private attribute any more: ask for every token's bytes
            special = {enc.encode_single_token(s) for s in enc.special_tokens_set}
            ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i not in special}
        table = b"".join(
            len(b).to_bytes(4, "little") + b + r.to_bytes(8, "little")
            for b, r in sorted(ranks.items(), key=lambda kv: kv[1])
        )
        specials = sorted(self.special_tokens.items(), key=lambda kv: kv[1])
        return digest(self.library, getattr(enc, "_pat_str", ""), table, json.dumps(specials))

    @cached_property
    def special_tokens(self) -> dict[str, int]:
        return {s: self.obj.encode_single_token(s) for s in self.obj.special_tokens_set}

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    @cached_property
    def vocab_size(self) -> int:
        return self.obj.n_vocab

    def encode(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[list[int]]:
        enc = self.obj
        if split_special_tokens:
            return [enc.encode_ordinary(texts[0])] if len(texts) == 1 else enc.encode_ordinary_batch(texts)
        if len(texts) == 1:  # encode_batch starts a thread pool per call
            return [enc.encode(texts[0], allowed_special="all")]
        return enc.encode_batch(texts, allowed_special="all")

    def encode_offsets(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[Encoding]:
        out = []
        for text, ids in zip(
            texts, self.encode(texts, add_special_tokens, split_special_tokens), strict=True
        ):
            pieces = self.obj.decode_tokens_bytes(ids)
            char_of = [
                i for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8", "surrogatepass")))
            ]
            offsets, at = [], 0
            for b in pieces:  # the characters whose bytes this token holds (part of one character: that one)
                offsets.append((char_of[at], char_of[at + len(b) - 1] + 1) if b else (0, 0))
                at += len(b)
            out.append(Encoding(list(ids), offsets, [b.decode("utf-8", "replace") for b in pieces]))
        return out

    def _drop(self, batch: list[list[int]], skip: bool) -> list[list[int]]:
        return [[i for i in ids if i not in self.special_ids] for ids in batch] if skip else batch

    def decode(self, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
        batch = self._drop(batch, skip_special_tokens)
        try:
            return [self.obj.decode(batch[0])] if len(batch) == 1 else self.obj.decode_batch(batch)
        except KeyError as e:  # an id in a gap of the vocabulary (below n_vocab, yet no token)
            raise InvalidInputError(
                expected_got(
                    "detokenize(ids)",
                    "ids of tokens of this tiktoken encoding",
                    f"KeyError({e.args[0] if e.args else ''!s})",
                    "Ids must come from this tokenizer's vocabulary.",
                )
            ) from e

    def decode_one(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.decode([ids], skip_special_tokens)[0]


class SentencePieceAdapter(Adapter):
    """A ``sentencepiece.SentencePieceProcessor``: ``encode`` / ``decode`` on lists (its batch path).

    ``add_special_tokens=True`` encodes with the processor's own ``add_bos`` / ``add_eos`` settings, False
    with neither. Special ids for ``skip_special_tokens``: control symbols (``<s>``, ``</s>``, ``<pad>``;
    sentencepiece's decode drops them anyway) and the unknown symbol. ``split_special_tokens`` is not
    supported (user-defined symbols always match the text, control symbols never do).
    """

    library = "sentencepiece"

    def _key(self) -> str:
        sp = self.obj
        flags = tuple(
            getattr(sp, f"_{n}", None)
            for n in (
                "add_bos",
                "add_eos",
                "reverse",
                "emit_unk_piece",
                "enable_sampling",
                "nbest_size",
                "alpha",
            )
        )
        return digest(self.library, sp.serialized_model_proto(), repr(flags))

    @cached_property
    def vocab_size(self) -> int:
        return self.obj.get_piece_size()

    @cached_property
    def special_ids(self) -> frozenset[int]:
        sp = self.obj
        return frozenset(i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i))

    def _encode(self, texts: list[str], add: bool, split: bool, out_type: Any) -> Any:
        if split:
            raise unsupported(
                self.library,
                "split_special_tokens",
                "Use split_special_tokens=False (user-defined symbols are always matched).",
            )
        kw = {} if add else {"add_bos": False, "add_eos": False}
        return self.obj.encode(texts, out_type=out_type, **kw)

    def encode(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[list[int]]:
        return self._encode(texts, add_special_tokens, split_special_tokens, int)

    def encode_offsets(
        self, texts: list[str], add_special_tokens: bool, split_special_tokens: bool
    ) -> list[Encoding]:
        try:
            out = self._encode(texts, add_special_tokens, split_special_tokens, "offset_mapping")
        except ValueError as e:  # out_type="offset_mapping" is recent (0.2.3 has it)
            raise unsupported(
                self.library,
                "return_offsets",
                "Upgrade sentencepiece: offsets need its encode(out_type='offset_mapping').",
            ) from e
        return [Encoding(list(d["ids"]), [tuple(o) for o in d["offsets"]], list(d["pieces"])) for d in out]

    def _drop(self, batch: list[list[int]], skip: bool) -> list[list[int]]:
        return [[i for i in ids if i not in self.special_ids] for ids in batch] if skip else batch

    def decode(self, batch: list[list[int]], skip_special_tokens: bool) -> list[str]:
        batch = self._drop(batch, skip_special_tokens)
        return list(self.obj.decode(batch)) if batch else []

    def decode_one(self, ids: list[int], skip_special_tokens: bool) -> str:
        ids = self._drop([ids], skip_special_tokens)[0]
        return self.obj.decode(ids) if ids else ""
