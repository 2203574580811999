"""Logprobs in OpenAI's shapes, from the engine's per-token ``{token id: raw logprob}`` dicts (the top-N and
the chosen token, vLLM's raw logprobs).

- Completions (OpenAI's legacy shape): ``{"tokens": [str], "token_logprobs": [float | None], "top_logprobs":
  [{str: float} | None], "text_offset": [int]}``; with ``echo`` the prompt's entries come first and the first
  one is null (no token precedes it). ``top_logprobs`` holds the engine's dict (the top-N plus the chosen
  token when it is not among them, vLLM's behaviour), most likely first.
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``,
  ``top_logprobs`` exactly the N most likely.

A token's string is its own bytes decoded as UTF-8. A token that is not valid UTF-8 alone (a partial
character of byte-level BPE, a ``<0xE2>`` byte-fallback piece) is written ``bytes:\\xe2\\x80`` (OpenAI's
form), and when two tokens of one ``top_logprobs`` dict would still get the same string, the later one is
keyed ``bytes:...`` and then ``token_id:N`` (vLLM's form): no entry ever overwrites another.
``-inf`` (a token masked out) is written -9999.0, as vLLM does (JSON has no infinity). ``text_offset`` is
the character offset of each token in the returned text (the completion, or prompt + completion with
``echo``): the characters the tokens before it decode to (a partial character counts once complete).
"""

from __future__ import annotations

import codecs
import math
import re
from typing import Any

__all__ = ["LegacyLogprobs", "TokenStrings", "chat_logprobs", "clamp"]

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def clamp(lp: float) -> float:
    """A logprob as JSON can carry it: ``-inf`` (and anything below) becomes -9999.0."""
    return lp if math.isfinite(lp) and lp > -9999.0 else -9999.0


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: the printable character standing for each byte -> the
    byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenStrings:
    """Token id -> (bytes, display string) for one tokenizer, cached. Byte-level BPE tokenizers (GPT-2,
    Llama 3, Qwen) map each piece's characters back to bytes; SentencePiece byte-fallback pieces ``<0xNN>``
    are that byte; other pieces are ``decode([id])`` (``"▁"`` read as a space); special tokens their text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        dec = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in type(dec).__name__ or "ByteLevel" in repr(dec)[:200]
        self.special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self._bytes: dict[int, bytes] = {}
        self._inv = _byte_decoder() if self.byte_level else {}

    def bytes_of(self, tid: int) -> bytes:
        """The bytes token ``tid`` stands for."""
        b = self._bytes.get(tid)
        if b is None:
            b = self._bytes[tid] = self._compute(tid)
        return b

    def _compute(self, tid: int) -> bytes:
        piece = self.tok.convert_ids_to_tokens(tid)
        if piece is None:
            return b""
        if tid in self.special:
            return piece.encode("utf-8")
        m = _BYTE_PIECE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.byte_level and all(c in self._inv for c in piece):
            return bytes(self._inv[c] for c in piece)
        return self.tok.decode([tid], skip_special_tokens=False).encode("utf-8")

    def text(self, tid: int) -> str:
        """The display string: the bytes as UTF-8, or ``bytes:\\xNN...`` when they are not valid UTF-8."""
        b = self.bytes_of(tid)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def keyed(self, entries: dict[int, float]) -> dict[str, float]:
        """``{token id: logprob}`` as ``{display string: logprob}``, most likely first, no two keys equal."""
        out: dict[str, float] = {}
        for tid, lp in sorted(entries.items(), key=lambda kv: -kv[1]):
            key = self.text(tid)
            if key in out:
                key = "bytes:" + "".join(f"\\x{x:02x}" for x in self.bytes_of(tid))
            if key in out:
                key = f"token_id:{tid}"
            out[key] = clamp(lp)
        return out


class LegacyLogprobs:
    """Builds the completions shape chunk by chunk (one per completion): :meth:`add` returns the dict of
    the tokens it is given, ``text_offset`` continuing where the previous chunk ended."""

    def __init__(self, strings: TokenStrings) -> None:
        self.strings = strings
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids: list[int], lps: list[dict[int, float] | None]) -> dict[str, list]:
        """The entries of ``token_ids`` with their logprob dicts (None: no logprob, the prompt's first)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps, strict=True):
            tokens.append(self.strings.text(tid))
            offsets.append(self.offset)
            self.offset += len(self._utf8.decode(self.strings.bytes_of(tid)))
            if d is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(clamp(d[tid]) if tid in d else None)
            tops.append(self.strings.keyed(d))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    strings: TokenStrings, token_ids: list[int], lps: list[dict[int, float]], top_n: int
) -> dict[str, list]:
    """OpenAI's chat ``logprobs`` of ``token_ids``: each token's string, logprob and bytes, and its ``top_n``
    most likely alternatives."""
    content = []
    for tid, d in zip(token_ids, lps, strict=True):
        top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(
            {
                "token": strings.text(tid),
                "logprob": clamp(d.get(tid, -math.inf)),
                "bytes": list(strings.bytes_of(tid)),
                "top_logprobs": [
                    {"token": strings.text(t), "logprob": clamp(lp), "bytes": list(strings.bytes_of(t))}
                    for t, lp in top
                ],
            }
        )
    return {"content": content}
