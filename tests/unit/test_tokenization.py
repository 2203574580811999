"""``lz.tokenize`` / ``lz.detokenize`` / ``lz.IncrementalDetokenizer`` on their own: return shapes, options
(special tokens added, split, skipped), tokenizer paths, the content-keyed adapter cache, the streaming
detokenizer's hold-back / prompt context / flush, the engine's use of it, and typed errors for bad input.
The parity with each library on a hard corpus is tests/correctness/test_tokenization_parity.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import layerzero as lz
from layerzero.core.errors import InvalidInputError
from layerzero.testing import tokenizer_zoo as zoo
from layerzero.tokenization import _cache, cache_info, clear_cache, resolve

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


@pytest.fixture(scope="module")
def bpe():
    return zoo.byte_level_bpe()


@pytest.fixture(scope="module")
def sp_proto():
    pytest.importorskip("sentencepiece", reason="sentencepiece is not installed (pip install sentencepiece)")
    return zoo.sentencepiece_model()


@pytest.fixture
def tik():
    pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")
    return zoo.tiktoken_encoding()


def _sp(proto, **kw):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=proto, **kw)


# ------------------------------------------------------------------------------------------------ the API
def test_import_layerzero_loads_no_tokenizer_library():
    code = (
        "import sys, layerzero as lz; lz.tokenize, lz.IncrementalDetokenizer; print(sorted(m for m in "
        "('tokenizers', 'transformers', 'tiktoken', 'sentencepiece') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names():
    for name in ("tokenize", "detokenize", "IncrementalDetokenizer", "Encoding"):
        assert name in lz.__all__ and getattr(lz, name) is getattr(lz.tokenization, name)


def test_one_text_gives_one_result_and_a_list_gives_a_list(bpe):
    one = lz.tokenize("Hello, world!", bpe)
    assert one == bpe.encode("Hello, world!").ids and isinstance(one[0], int)
    assert lz.tokenize(["Hello, world!", ""], bpe) == [one, bpe.encode("").ids]
    assert lz.tokenize(("Hello, world!",), bpe) == [one]
    assert lz.tokenize([], bpe) == []
    enc = lz.tokenize("a", bpe, return_offsets=True)
    assert isinstance(enc, lz.Encoding) and enc.ids == bpe.encode("a").ids
    assert enc.offsets == [(0, 0), (0, 1), (0, 0)] and enc.tokens == ["<s>", "a", "</s>"]
    assert lz.detokenize(one, bpe) == bpe.decode(one, skip_special_tokens=False)
    assert lz.detokenize([one, []], bpe) == [bpe.decode(one, skip_special_tokens=False), ""]
    assert lz.detokenize([], bpe) == "" and lz.detokenize((), bpe) == ""


def test_tensors_and_numpy_ids_are_accepted(bpe):
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    ids = [r[:3] for r in lz.tokenize(["ab cd", "ef gh"], bpe, add_special_tokens=False)]
    want = lz.detokenize(ids, bpe)
    assert lz.detokenize(torch.tensor(ids), bpe) == want and lz.detokenize(np.array(ids), bpe) == want
    assert lz.detokenize(torch.tensor(ids[0]), bpe) == want[0]
    assert lz.detokenize([torch.tensor(r) for r in ids], bpe) == want
    assert lz.detokenize([np.int64(i) for i in ids[0]], bpe) == want[0]


def test_add_special_tokens(bpe, sp_proto, tik):
    assert lz.tokenize("a b", bpe)[0] == 1 and lz.tokenize("a b", bpe)[-1] == 2
    assert (
        lz.tokenize("a b", bpe, add_special_tokens=False) == bpe.encode("a b", add_special_tokens=False).ids
    )
    hf = zoo.transformers_fast(bpe)
    assert (
        lz.tokenize("a b", hf, add_special_tokens=False) == hf("a b", add_special_tokens=False)["input_ids"]
    )
    sp = _sp(sp_proto, add_bos=True)  # the processor's own setting is what True means
    assert lz.tokenize("a b", sp) == sp.encode("a b") and lz.tokenize("a b", sp)[0] == sp.bos_id()
    assert lz.tokenize("a b", sp, add_special_tokens=False) == sp.encode("a b", add_bos=False)
    assert lz.tokenize("a b", tik) == lz.tokenize("a b", tik, add_special_tokens=False)  # tiktoken adds none


def test_split_special_tokens(bpe, sp_proto, tik):
    text = "x <s> y"
    assert 1 in lz.tokenize(text, bpe, add_special_tokens=False)
    split = lz.tokenize(text, bpe, add_special_tokens=False, split_special_tokens=True)
    assert 1 not in split and lz.detokenize(split, bpe) == text
    assert 1 in lz.tokenize(text, bpe, add_special_tokens=False)  # the object itself is left as it was
    hf = zoo.transformers_fast(bpe)
    assert (
        lz.tokenize(text, hf, split_special_tokens=True) == hf(text, split_special_tokens=True)["input_ids"]
    )
    eot = tik.encode_single_token("<|endoftext|>")
    assert lz.tokenize("a<|endoftext|>", tik) == tik.encode("a<|endoftext|>", allowed_special="all")
    assert eot in lz.tokenize("a<|endoftext|>", tik)
    assert (
        lz.tokenize(["a<|endoftext|>"] * 2, tik, split_special_tokens=True)
        == [tik.encode_ordinary("a<|endoftext|>")] * 2
    )
    with pytest.raises(InvalidInputError, match="split_special_tokens.*sentencepiece"):
        lz.tokenize(text, _sp(sp_proto), split_special_tokens=True)


def test_skip_special_tokens(bpe, sp_proto, tik):
    ids = lz.tokenize("x <s> y", bpe)
    assert (
        lz.detokenize(ids, bpe, skip_special_tokens=True)
        == bpe.decode(ids, skip_special_tokens=True)
        == "x  y"
    )
    assert lz.detokenize(ids, bpe) == "<s>x <s> y</s>"
    ids = lz.tokenize("a<|endoftext|>b", tik)
    assert (
        lz.detokenize(ids, tik) == "a<|endoftext|>b"
        and lz.detokenize(ids, tik, skip_special_tokens=True) == "ab"
    )
    sp = _sp(sp_proto)
    ids = [sp.bos_id(), *sp.encode("ab"), sp.unk_id(), sp.eos_id()]
    assert lz.detokenize(ids, sp) == sp.decode(ids) and "\u2047" in lz.detokenize(ids, sp)
    assert lz.detokenize(ids, sp, skip_special_tokens=True) == sp.decode(ids[1:-2])


# ------------------------------------------------------------------------------------------------ paths
def test_paths_load_once_and_share_the_content_adapter(bpe, sp_proto, tmp_path):
    (tmp_path / "hf").mkdir()
    bpe.save(str(tmp_path / "hf" / "tokenizer.json"))
    a = resolve(str(tmp_path / "hf" / "tokenizer.json"))
    assert resolve(tmp_path / "hf") is a and resolve(str(tmp_path / "hf")) is a and resolve(bpe) is a
    assert cache_info()["paths"] == 2 and lz.tokenize("héllo", tmp_path / "hf") == bpe.encode("héllo").ids
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(sp_proto)
    sp = _sp(sp_proto)
    assert resolve(tmp_path / "sp") is resolve(sp) and lz.tokenize("héllo", tmp_path / "sp") == sp.encode(
        "héllo"
    )
    f = tmp_path / "hf" / "tokenizer.json"  # a rewritten file is loaded again
    b2 = zoo.byte_level_bpe()
    b2.add_special_tokens(["<new>"])
    b2.save(str(f))
    os.utime(f, ns=(1, 1))
    assert resolve(f) is not a and "<new>" in resolve(f).obj.get_vocab()


def test_bad_paths_raise_typed_errors(tmp_path):
    with pytest.raises(InvalidInputError, match="tokenizer path: expected an existing file"):
        lz.tokenize("x", tmp_path / "missing.json")
    with pytest.raises(InvalidInputError, match="tokenizer.json or tokenizer.model in it"):
        lz.tokenize("x", tmp_path)
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(
        InvalidInputError, match=r"expected a tokenizers \.json file or a sentencepiece \.model"
    ):
        lz.tokenize("x", str(tmp_path / "vocab.txt"))


# ------------------------------------------------------------------------------------------------ the cache
def test_content_equal_tokenizers_share_one_adapter_and_a_new_special_token_does_not(bpe):
    from tokenizers import Tokenizer

    a = resolve(bpe)
    twin = Tokenizer.from_str(bpe.to_str())
    assert resolve(twin) is a and resolve(bpe) is a and len(a.key) == 64
    other = Tokenizer.from_str(bpe.to_str())
    other.add_special_tokens(["<|tool|>"])
    b = resolve(other)
    assert (
        b is not a
        and b.key != a.key
        and lz.tokenize("<|tool|>", other, add_special_tokens=False) == [other.token_to_id("<|tool|>")]
    )
    assert resolve(twin) is a  # still shared


def test_in_place_changes_are_seen_and_the_stale_adapter_is_not_handed_out():
    from tokenizers import Tokenizer

    tok = zoo.byte_level_bpe()
    twin = Tokenizer.from_str(tok.to_str())
    a = resolve(tok)
    tok.add_special_tokens(["<|x|>"])  # the object behind `a` changed
    b = resolve(tok)
    assert b is not a and lz.tokenize("<|x|>", tok, add_special_tokens=False) == [tok.token_to_id("<|x|>")]
    c = resolve(twin)  # content equal to the old `tok`: a fresh adapter around twin, not the stale `a`
    assert (
        c is not a
        and c.obj is twin
        and lz.tokenize("<|x|>", twin, add_special_tokens=False) != [tok.token_to_id("<|x|>")]
    )


def test_transformers_tiktoken_and_sentencepiece_keys(bpe, sp_proto, tik):
    hf1, hf2 = zoo.transformers_fast(bpe), zoo.transformers_fast(bpe)
    assert resolve(hf1) is resolve(hf2) and resolve(hf1) is not resolve(bpe)
    hf2.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert resolve(hf2) is not resolve(hf1)
    assert resolve(zoo.tiktoken_encoding(name="other-name")) is resolve(tik)  # the name is not content
    assert resolve(zoo.tiktoken_encoding(extra_special={"<|x|>": 500})) is not resolve(tik)
    assert resolve(_sp(sp_proto)) is resolve(_sp(sp_proto))
    assert resolve(_sp(sp_proto, add_bos=True)) is not resolve(_sp(sp_proto))
    assert resolve(_sp(zoo.sentencepiece_model(user_symbols=("<a>",)))) is not resolve(_sp(sp_proto))


def test_the_cache_is_bounded_and_clears():
    from tokenizers import Tokenizer

    base = zoo.byte_level_bpe()
    toks = []
    for i in range(_cache.MAX_ADAPTERS + 3):
        t = Tokenizer.from_str(base.to_str())
        t.add_special_tokens([f"<s{i}>"])
        toks.append(t)
        resolve(t)
    assert cache_info()["adapters"] == _cache.MAX_ADAPTERS
    clear_cache()
    assert cache_info() == {"adapters": 0, "objects": 0, "paths": 0}


# ------------------------------------------------------------------------------------------------ streaming
def test_a_split_emoji_is_held_back_until_complete_and_flush_gives_the_rest(bpe):
    ids = lz.tokenize("a 👩🏿‍🚀", bpe, add_special_tokens=False)
    d = lz.IncrementalDetokenizer(bpe)
    steps = [d.step(t) for t in ids]
    assert "".join(steps) == "a 👩🏿‍🚀" and "" in steps and not any("\ufffd" in s for s in steps)
    cut = lz.IncrementalDetokenizer(bpe)
    partial = "".join(cut.step(t) for t in ids[:-1])  # the last character is not complete yet
    assert "\ufffd" not in partial and (partial + cut.flush()) == bpe.decode(ids[:-1])
    assert cut.flush() == "" and cut.text == bpe.decode(ids[:-1])


def test_the_prompt_primes_the_leading_space():
    uni = zoo.unigram()  # Metaspace: a decode starting at "▁the" drops its space
    prompt, rest = lz.tokenize("over", uni), lz.tokenize(" the dog", uni)
    alone = lz.IncrementalDetokenizer(uni)
    primed = lz.IncrementalDetokenizer(uni, prompt)
    assert "".join(alone.step(t) for t in rest) == "the dog"
    assert "".join(primed.step(t) for t in rest) == " the dog" and primed.token_ids == rest


def test_a_prompt_ending_inside_a_character_is_not_used_as_context(bpe):
    ids = lz.tokenize("ok 😀 go", bpe, add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if bpe.decode(ids[:i]).endswith("\ufffd"))
    d = lz.IncrementalDetokenizer(bpe, ids[:cut])
    assert "".join(d.step(t) for t in ids[cut:]) + d.flush() == bpe.decode(ids[cut:])


def test_sentencepiece_space_pieces_keep_their_spaces(sp_proto):
    sp = _sp(sp_proto)
    space, the = sp.piece_to_id("\u2581"), sp.piece_to_id("\u2581the")
    ids = [
        the,
        space,
        space,
        the,
        space,
        space,
        space,
        the,
    ]  # sentencepiece strips leading spaces of a decode
    d = lz.IncrementalDetokenizer(sp)
    assert "".join(d.step(t) for t in ids) + d.flush() == sp.decode(ids) == "the   the    the"


def test_engine_detokenizer_streams_through_the_public_one(bpe):
    from layerzero.engine.frontend.detokenizer import Detokenizer

    hf = zoo.transformers_fast(bpe)
    prompt, out = hf("Hello")["input_ids"], hf(" wörld 👍🏽 end", add_special_tokens=False)["input_ids"]
    det = Detokenizer(
        hf, prompt + [10_000], stop=("end",), skip_special_tokens=True
    )  # 10_000: past the vocab
    hits = [det.add(t, True) for t in [*out[:-1], 10_000, out[-1]]]
    assert hits[-1] == "end" and det.text == " wörld 👍🏽 " and det.delta(True) == " wörld 👍🏽 "


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "texts, match",
    [
        (3, r"tokenize\(texts\): expected a str or a list/tuple of str, got int 3"),
        (b"abc", r"got bytes b'abc'. Decode bytes first"),
        (["ok", None], r"tokenize\(texts\)\[1\]: expected a str, got NoneType"),
        (["ok", b"x"], r"tokenize\(texts\)\[1\]: expected a str, got bytes"),
        ({"a": 1}, r"expected a str or a list/tuple of str, got dict"),
    ],
)
def test_non_str_texts_raise(bpe, texts, match):
    with pytest.raises(InvalidInputError, match=match):
        lz.tokenize(texts, bpe)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([5, 400], r"detokenize\(ids\)\[1\]: expected a token id in \[0, 400\), got 400"),
        ([-1], r"detokenize\(ids\)\[0\]: expected a token id in \[0, 400\), got -1"),
        ([[5], [6, 10**9]], r"detokenize\(ids\)\[1\]\[1\]: expected a token id in \[0, 400\)"),
        ([5, 1.0], r"detokenize\(ids\)\[1\]: expected an int token id, got float 1.0"),
        ([True], r"detokenize\(ids\)\[0\]: expected an int token id, got bool True"),
        (["5"], r"expected an int token id, got str '5'"),
        ([[5], 6], r"detokenize\(ids\)\[1\]: expected a list of int token ids \(every row"),
        ([5, [6]], r"detokenize\(ids\)\[1\]: expected an int token id, got list"),
        (5, r"detokenize\(ids\): expected a list of int token ids"),
        ("abc", r"detokenize\(ids\): expected a list of int token ids"),
    ],
)
def test_bad_ids_raise(bpe, ids, match):
    with pytest.raises(InvalidInputError, match=match):
        lz.detokenize(ids, bpe)


def test_an_id_in_a_tiktoken_gap_raises(tik):
    with pytest.raises(InvalidInputError, match="ids of tokens of this tiktoken encoding"):
        lz.detokenize([97, tik.n_vocab - 4], tik)


@pytest.mark.parametrize("tok", [object(), {"vocab": {}}, 3, None, [1, 2]])
def test_unknown_tokenizer_types_raise(tok):
    with pytest.raises(
        InvalidInputError, match=r"tokenizer: expected a tokenizers.Tokenizer, .* got builtins\."
    ):
        lz.tokenize("x", tok)
    with pytest.raises(InvalidInputError, match=r"tokenizer: expected"):
        lz.detokenize([1], tok)
    with pytest.raises(InvalidInputError, match=r"tokenizer: expected"):
        lz.IncrementalDetokenizer(tok)


def test_streaming_bad_input_raises(bpe):
    d = lz.IncrementalDetokenizer(bpe)
    for bad, match in (
        (400, r"step\(token_id\): expected a token id in \[0, 400\), got 400"),
        ("a", r"step\(token_id\): expected an int token id, got str"),
        (None, "got NoneType"),
    ):
        with pytest.raises(InvalidInputError, match=match):
            d.step(bad)
    with pytest.raises(InvalidInputError, match=r"extend\(token_ids\)\[1\]: expected a token id"):
        d.extend([5, 999])
    with pytest.raises(InvalidInputError, match=r"prompt_ids\)\[0\]: expected a token id"):
        lz.IncrementalDetokenizer(bpe, [10**6])
    with pytest.raises(InvalidInputError, match=r"prompt_ids\): expected one sequence"):
        lz.IncrementalDetokenizer(bpe, [[1], [2]])
    with pytest.raises(InvalidInputError, match=r"context_tokens\): expected an int >= 0, got -1"):
        lz.IncrementalDetokenizer(bpe, context_tokens=-1)
    assert d.text == "" and d.token_ids == []  # nothing half-added
    assert isinstance(InvalidInputError("x"), ValueError)
