"""OpenAI's logprob shapes worked out by hand on a byte-level tokenizer double: partial UTF-8 tokens keyed
``bytes:\\xNN``, colliding strings never overwrite each other, ``-inf`` as -9999, text offsets in characters;
then the real tiny tokenizer: every token's bytes concatenate to the decoded text."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from layerzero.engine.entrypoints.openai.logprobs import LegacyLogprobs, TokenStrings, chat_logprobs

pytestmark = pytest.mark.unit


class ByteLevel:  # what TokenStrings recognises: a byte-level BPE decoder
    pass


class Tok:
    """Byte-level pieces: 'Ġhi' = b' hi', 'âĢ' = b'\\xe2\\x80', 'Ļ' = b'\\x99' ('âĢĻ' is U+2019), a
    SentencePiece-style '<0x20>' (b' ', the same bytes as 'Ġ'), 'Ġ' and the special '</s>'."""

    pieces = {0: "Ġhi", 1: "âĢ", 2: "Ļ", 3: "<0x20>", 4: "Ġ", 5: "</s>", 6: "!"}
    backend_tokenizer = SimpleNamespace(decoder=ByteLevel())
    all_special_ids = [5]

    def convert_ids_to_tokens(self, i):
        return self.pieces[i]

    def decode(self, ids, skip_special_tokens=False):
        raise AssertionError("not needed for byte-level pieces")


def test_token_bytes_and_display_strings():
    s = TokenStrings(Tok())
    assert s.byte_level
    assert [s.bytes_of(i) for i in range(7)] == [b" hi", b"\xe2\x80", b"\x99", b" ", b" ", b"</s>", b"!"]
    assert s.text(0) == " hi" and s.text(5) == "</s>"
    assert s.text(1) == "bytes:\\xe2\\x80" and s.text(2) == "bytes:\\x99"
    assert (s.bytes_of(1) + s.bytes_of(2)).decode() == "\u2019"


def test_colliding_strings_get_distinct_keys_most_likely_first():
    s = TokenStrings(Tok())
    keyed = s.keyed({4: -2.0, 3: -1.0, 0: -0.5, 6: -math.inf})
    assert list(keyed) == [" hi", " ", "bytes:\\x20", "!"]
    assert keyed == {" hi": -0.5, " ": -1.0, "bytes:\\x20": -2.0, "!": -9999.0}


def test_legacy_shape_by_hand_with_offsets_across_a_split_character():
    s = TokenStrings(Tok())
    b = LegacyLogprobs(s)
    first = b.add([0, 1], [None, {1: -0.25, 2: -1.5}])
    assert first == {
        "tokens": [" hi", "bytes:\\xe2\\x80"],
        "token_logprobs": [None, -0.25],
        "top_logprobs": [None, {"bytes:\\xe2\\x80": -0.25, "bytes:\\x99": -1.5}],
        "text_offset": [0, 3],
    }
    second = b.add([2, 6], [{2: -0.1}, {0: -0.3, 6: -0.7}])
    # ' hi' is 3 characters; 'âĢ' + 'Ļ' complete one character (U+2019), so '!' starts at 4
    assert second["text_offset"] == [3, 4]
    assert second["token_logprobs"] == [-0.1, -0.7] and second["top_logprobs"][1] == {" hi": -0.3, "!": -0.7}


def test_chat_shape_by_hand():
    s = TokenStrings(Tok())
    out = chat_logprobs(s, [2, 6], [{2: -0.1, 0: -3.0}, {0: -0.3, 6: -0.7, 1: -2.0}], top_n=1)
    assert out == {
        "content": [
            {
                "token": "bytes:\\x99",
                "logprob": -0.1,
                "bytes": [0x99],
                "top_logprobs": [{"token": "bytes:\\x99", "logprob": -0.1, "bytes": [0x99]}],
            },
            {
                "token": "!",
                "logprob": -0.7,
                "bytes": [33],
                "top_logprobs": [{"token": " hi", "logprob": -0.3, "bytes": [32, 104, 105]}],
            },
        ]
    }


def test_real_tokenizer_bytes_concatenate_to_the_text(checkpoints):
    from layerzero.testing.checkpoints import train_tokenizer

    tok = train_tokenizer()
    s = TokenStrings(tok)
    assert s.byte_level
    text = "the quick brown fox: caf\u00e9 \u2019 \u00fcber 12."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert b"".join(s.bytes_of(i) for i in ids).decode() == tok.decode(ids) == text
    assert all(len(s.keyed(dict.fromkeys(range(k, k + 20), -1.0))) == 20 for k in range(0, 500, 20))
