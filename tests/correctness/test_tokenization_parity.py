"""``lz.tokenize`` / ``lz.detokenize`` / ``lz.IncrementalDetokenizer`` against each library's own calls, on a
corpus with CJK, accents, combining marks, right-to-left scripts, emoji with skin tones and ZWJ sequences,
whitespace runs, tabs, newlines and the empty string (``layerzero.testing.tokenizer_zoo``): the ids, offsets
and text are the library's; offsets point at the text each token came from; streaming one token at a time adds
up to the full decode and shows no U+FFFD on the way; random id sequences (split characters, special tokens)
stream to the full decode too."""

from __future__ import annotations

import random
import unicodedata

import pytest

import layerzero as lz
from layerzero.testing import tokenizer_zoo as zoo
from layerzero.tokenization import resolve

pytestmark = pytest.mark.correctness
CORPUS = list(zoo.CORPUS)
KINDS = ("bpe", "wordpiece", "unigram", "transformers", "tiktoken", "sp_bpe", "sp_unigram")


def _needs(module: str) -> None:
    pytest.importorskip(module, reason=f"{module} is not installed (pip install {module})")


@pytest.fixture(scope="module")
def zoo_tokenizers() -> dict:
    class Lazy(dict):
        def __missing__(self, kind: str):
            if kind.startswith("sp_"):
                _needs("sentencepiece")
                import sentencepiece as spm

                tok = spm.SentencePieceProcessor(model_proto=zoo.sentencepiece_model(kind[3:]))
            elif kind == "tiktoken":
                _needs("tiktoken")
                tok = zoo.tiktoken_encoding()
            elif kind == "transformers":
                _needs("transformers")
                tok = zoo.transformers_fast()
            else:
                tok = {"bpe": zoo.byte_level_bpe, "wordpiece": zoo.wordpiece, "unigram": zoo.unigram}[kind]()
            self[kind] = tok
            return tok

    return Lazy()


@pytest.fixture(params=KINDS)
def kind_tok(request, zoo_tokenizers):
    return request.param, zoo_tokenizers[request.param]


def own_encode(kind: str, tok, text: str) -> list[int]:
    """The library's own ids (special-token text encoded as the special token; BOS/EOS as the library
    adds)."""
    if kind in ("bpe", "wordpiece", "unigram"):
        return tok.encode(text).ids
    if kind == "transformers":
        return tok(text)["input_ids"]
    if kind == "tiktoken":
        return tok.encode(text, allowed_special="all")
    return tok.encode(text)


def own_decode(kind: str, tok, ids: list[int], skip: bool = False) -> str:
    if kind in ("bpe", "wordpiece", "unigram", "transformers"):
        return tok.decode(ids, skip_special_tokens=skip)
    if kind == "tiktoken":
        return tok.decode([i for i in ids if not (skip and i in tok._special_tokens.values())])
    drop = {i for i in ids if tok.is_control(i) or tok.is_unknown(i)} if skip else set()
    return tok.decode([i for i in ids if i not in drop])


def test_ids_equal_the_librarys_own_single_and_batched(kind_tok):
    kind, tok = kind_tok
    want = [own_encode(kind, tok, t) for t in CORPUS]
    assert lz.tokenize(CORPUS, tok) == want
    assert [lz.tokenize(t, tok) for t in CORPUS] == want
    assert lz.tokenize(tuple(CORPUS), tok, return_offsets=True)[5].ids == want[5]
    assert any(len(w) > 10 for w in want) and all(isinstance(i, int) for w in want for i in w)


def test_detokenize_of_tokenize_is_the_librarys_decode(kind_tok):
    kind, tok = kind_tok
    ids = lz.tokenize(CORPUS, tok)
    for skip in (False, True):
        want = [own_decode(kind, tok, i, skip) for i in ids]
        assert lz.detokenize(ids, tok, skip_special_tokens=skip) == want
        assert [lz.detokenize(i, tok, skip_special_tokens=skip) for i in ids] == want
    if kind in ("bpe", "tiktoken", "transformers"):  # byte-level: lossless without the added BOS/EOS
        assert lz.detokenize(lz.tokenize(CORPUS, tok, add_special_tokens=False), tok) == CORPUS


def _token_bytes(kind: str, tok, enc: lz.Encoding) -> list[bytes] | None:
    if kind == "tiktoken":
        return tok.decode_tokens_bytes(enc.ids)
    if kind in ("bpe", "transformers"):
        u2b = zoo._unicode_to_byte()
        return [t.encode() if t in zoo.SPECIAL else bytes(u2b[c] for c in t) for t in enc.tokens]
    return None


def test_offsets_are_the_librarys_and_point_at_the_tokens_text(kind_tok):
    kind, tok = kind_tok
    encs = lz.tokenize(CORPUS, tok, return_offsets=True)
    for text, enc in zip(CORPUS, encs, strict=True):
        assert enc.ids == own_encode(kind, tok, text) and len(enc.offsets) == len(enc.ids) == len(enc.tokens)
        assert all(0 <= s <= e <= len(text) for s, e in enc.offsets)
        if kind in ("bpe", "wordpiece", "unigram"):
            e = tok.encode(text)
            assert enc.offsets == e.offsets and enc.tokens == e.tokens
        elif kind == "transformers":
            assert enc.offsets == [tuple(o) for o in tok(text, return_offsets_mapping=True)["offset_mapping"]]
        elif kind.startswith("sp_"):
            assert enc.offsets == [tuple(o) for o in tok.encode(text, out_type="offset_mapping")["offsets"]]
            for piece, i, (s, e) in zip(enc.tokens, enc.ids, enc.offsets, strict=True):
                if not (tok.is_byte(i) or tok.is_unknown(i) or tok.is_control(i)):  # a piece of the text
                    assert _visible(text[s:e]) == _visible(piece.replace("\u2581", " "))
        elif kind == "tiktoken":  # tiktoken's own start offsets
            assert [s for s, _ in enc.offsets] == tok.decode_with_offsets(enc.ids)[1]
        plain = lz.tokenize(text, tok, return_offsets=True, add_special_tokens=False)  # no BOS/EOS
        pieces = _token_bytes(kind, tok, plain)
        if pieces is not None:  # byte-level: each token's bytes lie in the characters its offsets name
            assert b"".join(pieces) == text.encode()
            for b, (s, e) in zip(pieces, plain.offsets, strict=True):
                assert b in text[s:e].encode() and e > s
        if kind == "wordpiece":
            for t, (s, e) in zip(enc.tokens, enc.offsets, strict=True):
                if t != "<unk>":
                    bare = "".join(
                        c
                        for c in unicodedata.normalize("NFD", text[s:e].lower())
                        if unicodedata.category(c) not in ("Mn", "Cf")
                    )  # BertNormalizer's drops
                    assert t.removeprefix("##") in bare  # a character may hold several pieces (Hangul)


def _visible(s: str) -> str:
    """``s`` under NFKC without whitespace and format characters (what sentencepiece's normalizer drops)."""
    return "".join(
        c for c in unicodedata.normalize("NFKC", s) if not c.isspace() and unicodedata.category(c) != "Cf"
    )


def _stream(tok, ids: list[int], skip: bool = False, prompt: list[int] = ()) -> tuple[list[str], str]:
    d = lz.IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    steps = [d.step(t) for t in ids]
    tail = d.flush()
    assert d.text == "".join(steps) + tail and d.token_ids == ids
    return steps, tail


def test_streaming_one_token_at_a_time_adds_up_to_the_full_decode(kind_tok):
    kind, tok = kind_tok
    for skip in (False, True):
        for ids in lz.tokenize(CORPUS, tok):
            full = own_decode(kind, tok, ids, skip)
            steps, tail = _stream(tok, ids, skip)
            assert "".join(steps) + tail == full
            assert tail == ""  # well-formed text: nothing is left held back
            assert not any("\ufffd" in s for s in steps)  # never a replacement character mid-stream


def test_streaming_after_a_prompt_continues_its_text(kind_tok):
    kind, tok = kind_tok
    checked = 0
    for ids in lz.tokenize(CORPUS, tok, add_special_tokens=False):
        for cut in range(1, len(ids), 3):
            head, whole = own_decode(kind, tok, ids[:cut]), own_decode(kind, tok, ids)
            if "\ufffd" in head or not whole.startswith(head):
                continue  # the prompt ends inside a character, or decoding it alone differs (a leading space)
            steps, tail = _stream(tok, ids[cut:], prompt=ids[:cut])
            assert "".join(steps) + tail == whole[len(head) :]
            checked += 1
    assert checked >= 20


def test_random_ids_stream_to_the_full_decode(kind_tok):
    """Random ids: characters split across tokens (and never completed), special tokens, whitespace-only
    pieces; with and without skipping special tokens."""
    kind, tok = kind_tok
    n = resolve(tok).vocab_size
    valid = [i for i in range(n) if kind != "tiktoken" or i < n - 7 or i >= n - 2]  # tiktoken: not the gap
    rng = random.Random(kind)
    for trial in range(150):
        ids = [rng.choice(valid) for _ in range(rng.randint(0, 24))]
        skip = trial % 2 == 1
        steps, tail = _stream(tok, ids, skip)
        assert (
            "".join(steps) + tail
            == own_decode(kind, tok, ids, skip)
            == lz.detokenize(ids, tok, skip_special_tokens=skip)
        )
        assert not any(s.endswith("\ufffd") for s in steps)  # held back until the character is complete


def test_extend_several_tokens_at_once_matches_single_steps(kind_tok):
    kind, tok = kind_tok
    rng = random.Random(1)
    for ids in lz.tokenize(CORPUS, tok):
        d = lz.IncrementalDetokenizer(tok)
        at, out = 0, []
        while at < len(ids):
            k = rng.randint(1, 4)
            out.append(d.extend(ids[at : at + k]))
            at += k
        assert "".join(out) + d.flush() == own_decode(kind, tok, ids)
