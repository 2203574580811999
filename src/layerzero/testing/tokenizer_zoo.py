"""Small tokenizers of every supported library, built here with no network, and a corpus that is hard on
them: Unicode (CJK, accents, combining marks, right-to-left scripts, astral-plane symbols), emoji with skin
tones and ZWJ sequences, whitespace runs, tabs, newlines and the empty string. Used by the tokenization tests
(``lz.tokenize`` / ``lz.detokenize`` / ``lz.IncrementalDetokenizer`` against each library's own calls).

Each builder imports its library lazily and is deterministic for a given corpus.
"""

from __future__ import annotations

import io
import json
from typing import Any

__all__ = [
    "CORPUS",
    "SPECIAL",
    "byte_level_bpe",
    "sentencepiece_model",
    "tiktoken_encoding",
    "train_text",
    "transformers_fast",
    "unigram",
    "wordpiece",
]

CORPUS: tuple[str, ...] = (
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n  mixed \t whitespace runs      end\t\t",
    "Café naïve résumé Ångström façade",
    "e\u0301 combining a\u0308 o\u0323\u0302 Z\u0335\u0321a\u0336l\u0337g\u0338o",
    "日本語のテキストです。中文测试，한국어 텍스트",
    "مرحبا بالعالم — שלום עולם — ٣٤٥",
    "emoji 😀😃 👍🏽 👩🏿‍🚀 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ end",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝄞 and numbers 12345 3.14159",
    "I'm sure they've said we'll go, can't they? <s> special </s> inside",
    "\u200b zero width \ufeff BOM and NBSP\u00a0here",
    "🙂",
    "     ",
    "x" * 40 + " " + "ab" * 30,
)
"""Test lines; each library must give these the same ids through LayerZero as through its own calls."""

SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
"""Special tokens of the HF tokenizers (ids 0..3)."""

_EXTRA = (
    "The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces; the pieces "
    "map to ids, and ids map back to text. 0123456789 !?.,;:'\"()[]{}"
)


def train_text(repeat: int = 4) -> list[str]:
    """The training text: the corpus (minus its empty line) and an English sentence, ``repeat`` times."""
    return [line for line in (*CORPUS, _EXTRA) if line] * repeat


def _tokenizers() -> Any:
    import tokenizers

    return tokenizers


def byte_level_bpe(vocab_size: int = 400) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE (GPT-2 / Llama 3 / Qwen style), BOS/EOS post-processor."""
    t = _tokenizers()
    tok = t.Tokenizer(t.models.BPE())
    tok.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = t.decoders.ByteLevel()
    trainer = t.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        show_progress=False,
        initial_alphabet=t.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(train_text(), trainer=trainer)
    tok.post_processor = t.processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return tok


def wordpiece(vocab_size: int = 400) -> Any:
    """A ``tokenizers.Tokenizer``: BERT-style WordPiece (NFD + lowercase + strip accents, ``##`` pieces)."""
    t = _tokenizers()
    tok = t.Tokenizer(t.models.WordPiece(unk_token="<unk>"))
    tok.normalizer = t.normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = t.pre_tokenizers.BertPreTokenizer()
    tok.decoder = t.decoders.WordPiece()
    trainer = t.trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False
    )
    tok.train_from_iterator(train_text(), trainer=trainer)
    return tok


def unigram(vocab_size: int = 300) -> Any:
    """A ``tokenizers.Tokenizer``: Unigram with Metaspace ("▁" spaces, sentencepiece style) and NFKC."""
    t = _tokenizers()
    tok = t.Tokenizer(t.models.Unigram())
    tok.normalizer = t.normalizers.NFKC()
    tok.pre_tokenizer = t.pre_tokenizers.Metaspace()
    tok.decoder = t.decoders.Metaspace()
    trainer = t.trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL), unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(train_text(), trainer=trainer)
    return tok


def transformers_fast(tok: Any | None = None) -> Any:
    """A transformers ``PreTrainedTokenizerFast`` around ``tok`` (default: :func:`byte_level_bpe`)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok or byte_level_bpe(),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


_BYTE_LEVEL = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted."""
    bs, cs, n = list(_BYTE_LEVEL), list(_BYTE_LEVEL), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def tiktoken_encoding(name: str = "lz-test", extra_special: dict[str, int] | None = None) -> Any:
    """A ``tiktoken.Encoding`` with GPT-2's split pattern and ranks learned from the corpus: the 256 bytes,
    then the merges of :func:`byte_level_bpe` in their order. Special tokens ``<|endoftext|>`` and
    ``<|fim|>`` sit after a gap of 5 unused ids (ids in a gap decode to nothing: a test of bad ids)."""
    import tiktoken

    u2b = _unicode_to_byte()
    model = json.loads(byte_level_bpe().to_str())["model"]
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for m in model["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        tok = bytes(u2b[c] for c in a + b)
        ranks.setdefault(tok, len(ranks))
    base = len(ranks) + 5
    special = {"<|endoftext|>": base, "<|fim|>": base + 1, **(extra_special or {})}
    return tiktoken.Encoding(name=name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def sentencepiece_model(model_type: str = "bpe", user_symbols: tuple[str, ...] = ("<tool>",)) -> bytes:
    """A serialized sentencepiece model trained on the corpus (``model_type`` "bpe" or "unigram"), with byte
    fallback (characters it has not kept become ``<0xNN>`` pieces) and ``user_symbols`` matched in text."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(train_text()),
        model_writer=out,
        vocab_size=480,
        model_type=model_type,
        byte_fallback=True,
        character_coverage=0.98,
        user_defined_symbols=list(user_symbols),
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    return out.getvalue()
