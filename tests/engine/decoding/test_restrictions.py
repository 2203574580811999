"""Per-request token restrictions: ``allowed_token_ids`` and bad words (vLLM's rule) in the sampler,
hand-worked on tiny logits, then through the engine over seeded sampling (output never holds a banned token or
word), and the front end's bad-word tokenization."""

from __future__ import annotations

import math

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration
FAMILY = "qwen3"


def _rows(params, outputs):
    from layerzero.engine.core.sched.output import SamplingMetadata

    n = len(params)
    return SamplingMetadata(list(params), [None] * n, [len(o or ()) for o in outputs], [None] * n, outputs)


def test_restrict_tokens_hand_worked():
    from layerzero.engine import SamplingParams
    from layerzero.engine.worker.logits_restrict import restrict_tokens

    logits = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    before = logits.clone()
    params = [
        SamplingParams(allowed_token_ids=[1, 4]),
        SamplingParams(),  # untouched
        SamplingParams(bad_words_token_ids=[[5], [2, 3], [9, 2, 0]]),
        SamplingParams(allowed_token_ids=[0, 3], bad_words_token_ids=[[3]]),
    ]
    # row 2's output ends with 2: word [2, 3] bans 3; word [9, 2, 0] needs (9, 2): output ends (1, 2) -> no
    # ban
    restrict_tokens(logits, _rows(params, [None, None, [1, 2], []]))
    inf = -math.inf
    expected = [
        [inf, 1.0, inf, inf, 4.0, inf],
        [6.0, 7, 8, 9, 10, 11],
        [12.0, 13, 14, inf, 16, inf],
        [18.0, inf, inf, inf, inf, inf],
    ]
    assert logits.tolist() == expected
    assert torch.equal(logits[1], before[1])


def test_bad_word_bans_rule():
    from layerzero.engine.worker.logits_restrict import bad_word_bans, bad_words_tail

    words = ((7,), (1, 2), (4, 1, 2))
    assert bad_word_bans(words, []) == [7]  # (1, 2) needs a 1 before; (4, 1, 2) longer than output + 1
    assert bad_word_bans(words, [3, 1]) == [7, 2]
    assert bad_word_bans(words, [4, 1]) == [7, 2, 2]
    assert bad_word_bans(words, [1, 3]) == [7]
    assert bad_words_tail(words) == 2 and bad_words_tail(((5,),)) == 0 and bad_words_tail(None) == 0


@pytest.fixture(scope="module")
def llm(checkpoints):
    from layerzero.engine import LLM

    return LLM(
        checkpoints[FAMILY],
        device="cpu",
        dtype=torch.float32,
        max_model_len=64,
        num_kv_blocks=128,
        max_num_seqs=16,
    )


def _sp(**kw):
    from layerzero.engine import SamplingParams

    kw.setdefault("max_tokens", 12)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def test_allowed_token_ids_only_those_in_a_mixed_batch(llm):
    ps = prompts(4, seed=41, lo=4, hi=10)
    allowed = [5, 17, 99, 300]
    outs = llm.generate(
        ps,
        [
            _sp(temperature=1.0, seed=1, allowed_token_ids=allowed),
            _sp(temperature=1.0, seed=2),
            _sp(temperature=0.0, allowed_token_ids=[42]),
            _sp(temperature=0.0),
        ],
        use_tqdm=False,
    )
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    assert len(set(outs[0].outputs[0].token_ids)) > 1  # sampled, not stuck on one
    assert outs[2].outputs[0].token_ids == [42] * 12
    (plain,) = llm.generate([ps[3]], _sp(temperature=0.0), use_tqdm=False)
    assert outs[3].outputs[0].token_ids == plain.outputs[0].token_ids  # unrestricted rows untouched
    assert not set(outs[1].outputs[0].token_ids) <= set(allowed)


def _contains(seq, word):
    k = len(word)
    return any(tuple(seq[i : i + k]) == tuple(word) for i in range(len(seq) - k + 1))


def test_bad_words_never_generated_over_seeded_sampling(llm):
    p = prompts(1, seed=43, lo=6, hi=6)[0]
    # find tokens and a bigram the unrestricted model produces under these seeds
    free = llm.generate([p] * 6, [_sp(temperature=1.5, seed=s, top_k=4) for s in range(6)], use_tqdm=False)
    seqs = [o.outputs[0].token_ids for o in free]
    single = seqs[0][0]
    pair = next(
        (s[i], s[i + 1]) for s in seqs[1:] for i in range(len(s) - 1) if single not in (s[i], s[i + 1])
    )
    words = [[single], list(pair)]
    banned = llm.generate(
        [p] * 6,
        [_sp(temperature=1.5, seed=s, top_k=4, bad_words_token_ids=words) for s in range(6)],
        use_tqdm=False,
    )
    for o in banned:
        t = o.outputs[0].token_ids
        assert single not in t and not _contains(t, pair), (t, words)
    assert any(_contains(s, pair) for s in seqs)  # the ban did something


def test_bad_words_text_is_tokenized_with_and_without_space(llm):
    tok = llm.tokenizer
    proc = llm.input_processor
    sp = _sp(bad_words=["hello"], bad_words_token_ids=[[3]])
    out = proc.with_bad_words(sp)
    plain = tuple(tok("hello", add_special_tokens=False)["input_ids"])
    spaced = tuple(tok(" hello", add_special_tokens=False)["input_ids"])
    assert out.bad_words_token_ids[0] == (3,) and out.bad_words_token_ids[1] == plain
    assert (spaced in out.bad_words_token_ids) == (spaced[0] != plain[0] and len(spaced) == len(plain))
    assert proc.with_bad_words(out) is out  # idempotent


def test_bad_words_text_through_generate(llm):
    p = prompts(1, seed=44, lo=5, hi=5)[0]
    tok = llm.tokenizer
    (free,) = llm.generate([p], _sp(temperature=0.0), use_tqdm=False)
    word = tok.decode([free.outputs[0].token_ids[0]]).strip()
    assert word
    (o,) = llm.generate([p], _sp(temperature=0.0, bad_words=[word]), use_tqdm=False)
    ids = llm.input_processor.with_bad_words(_sp(bad_words=[word])).bad_words_token_ids
    t = o.outputs[0].token_ids
    assert not any(_contains(t, w) for w in ids)
    assert t != free.outputs[0].token_ids


def test_out_of_vocab_ids_rejected_before_queueing(llm):
    from layerzero import InvalidInputError

    p = prompts(1, seed=45)[0]
    for kw in ({"allowed_token_ids": [1, 10**6]}, {"bad_words_token_ids": [[1, 10**6]]}):
        with pytest.raises(InvalidInputError, match="vocab size"):
            llm.generate([p], _sp(**kw), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_under_async_scheduling_equal_sync(llm, checkpoints):
    """Multi-token bad words read the previous token: with async scheduling the step waits for it
    (``EngineLoop._needs_known_tokens``), so the seeded outputs equal the synchronous engine's."""
    from layerzero.engine import LLM

    fast = LLM(
        checkpoints[FAMILY],
        device="cpu",
        dtype=torch.float32,
        max_model_len=64,
        num_kv_blocks=128,
        max_num_seqs=16,
        async_scheduling=True,
    )
    p = prompts(3, seed=46, lo=5, hi=8)
    free = llm.generate(p, [_sp(temperature=1.5, seed=s, top_k=4) for s in range(3)], use_tqdm=False)
    t = free[0].outputs[0].token_ids
    words = [[t[1], t[2]], [t[3], t[4], t[5]], [free[1].outputs[0].token_ids[0]]]
    sps = [_sp(temperature=1.5, seed=s, top_k=4, bad_words_token_ids=words) for s in range(3)]
    sync = llm.generate(p, sps, use_tqdm=False)
    asyn = fast.generate(p, sps, use_tqdm=False)
    for a, b in zip(sync, asyn, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert not any(_contains(a.outputs[0].token_ids, w) for w in words)
    assert sync[0].outputs[0].token_ids != t
