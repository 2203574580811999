"""Stop conditions, worked out from the free-running greedy output: stop token ids (kept in token_ids),
EOS and ignore_eos, min_tokens, max_tokens, max_model_len, stop strings that span tokens (cut from the text),
and streaming deltas that never show part of a stop string; with and without async scheduling."""

from __future__ import annotations

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration
FAMILY = "qwen3"


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(checkpoints, request):
    """The engine, with and without async scheduling (which sees each stop one step late and drops the extra
    token: every test below holds in both)."""
    from layerzero.engine import LLM

    return LLM(
        checkpoints[FAMILY],
        device="cpu",
        dtype=torch.float32,
        max_model_len=64,
        num_kv_blocks=64,
        async_scheduling=request.param,
    )


def sp(**kw):
    from layerzero.engine import SamplingParams

    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 16)
    return SamplingParams(**kw)


@pytest.fixture(scope="module")
def free(llm):
    """(prompt, greedy tokens, greedy text) with no stop condition."""
    p = llm.tokenizer("The quick brown fox jumps over")["input_ids"]
    (o,) = llm.generate([p], sp(ignore_eos=True), use_tqdm=False)
    return p, o.outputs[0].token_ids, o.outputs[0].text


def test_stop_token_id_ends_the_output_and_is_kept(llm, free):
    p, tokens, _ = free
    stop = tokens[3]
    first = tokens.index(stop)
    (o,) = llm.generate([p], sp(ignore_eos=True, stop_token_ids=[stop]), use_tqdm=False)
    c = o.outputs[0]
    assert c.token_ids == tokens[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop


def test_min_tokens_bans_stop_ids_and_eos_until_reached(llm, free):
    p, tokens, _ = free
    stop = tokens[1]
    (o,) = llm.generate(
        [p], sp(ignore_eos=True, stop_token_ids=[stop], min_tokens=6, max_tokens=12), use_tqdm=False
    )
    c = o.outputs[0]
    assert stop not in c.token_ids[:6] and len(c.token_ids) >= 6
    assert c.finish_reason == "length" or c.token_ids[-1] == stop


def test_eos_stops_unless_ignored(llm, free):
    p, _, _ = free
    (o,) = llm.generate([p], sp(logit_bias={2: 100.0}, min_tokens=3), use_tqdm=False)
    c = o.outputs[0]
    assert (
        c.token_ids[-1] == 2 and len(c.token_ids) == 4 and c.finish_reason == "stop" and c.stop_reason is None
    )
    (o,) = llm.generate([p], sp(logit_bias={2: 100.0}, ignore_eos=True, max_tokens=5), use_tqdm=False)
    assert o.outputs[0].token_ids == [2] * 5 and o.outputs[0].finish_reason == "length"


def test_max_tokens_and_max_model_len(llm, free):
    p, tokens, _ = free
    (o,) = llm.generate([p], sp(ignore_eos=True, max_tokens=3), use_tqdm=False)
    assert o.outputs[0].token_ids == tokens[:3] and o.outputs[0].finish_reason == "length"
    long = prompts(1, seed=22, lo=62, hi=62)[0]
    (o,) = llm.generate([long], sp(ignore_eos=True, max_tokens=10), use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 2 and o.outputs[0].finish_reason == "length"


def _spanning_stop(llm, tokens, text):
    """A stop string whose first occurrence in the text starts in one token's text and ends in the next
    one's."""
    tok = llm.tokenizer
    pieces = [tok.decode(tokens[:i], skip_special_tokens=True) for i in range(len(tokens) + 1)]
    for i in range(1, len(tokens) - 1):
        a, b = pieces[i], pieces[i + 1]
        clean = "\ufffd" not in pieces[i + 2][len(pieces[i - 1]) :] and text.startswith(pieces[i + 2])
        if clean and len(a) > len(pieces[i - 1]) and len(b) > len(a):
            s = text[len(a) - 1 : len(a) + 1]
            if text.index(s) == len(a) - 1:
                return s, len(a) - 1
    pytest.skip("no pair of adjacent tokens with visible text")


def test_stop_string_spanning_tokens_is_cut_from_the_text(llm, free):
    p, tokens, text = free
    stop, at = _spanning_stop(llm, tokens, text)
    (o,) = llm.generate([p], sp(ignore_eos=True, stop=[stop, "never-there"]), use_tqdm=False)
    c = o.outputs[0]
    assert c.text == text[:at] and c.finish_reason == "stop" and c.stop_reason == stop


def test_stream_deltas_add_up_and_never_show_the_stop_string(llm, free):
    p, tokens, text = free
    stop, at = _spanning_stop(llm, tokens, text)
    deltas = list(llm.stream(p, sp(ignore_eos=True, stop=stop)))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    joined = "".join(d.outputs[0].text for d in deltas)
    assert joined == text[:at]
    assert [t for d in deltas for t in d.outputs[0].token_ids] == tokens[
        : len(sum((d.outputs[0].token_ids for d in deltas), []))
    ]


def test_leaving_a_stream_early_aborts_the_request(llm, free):
    p, _, _ = free
    for _ in llm.stream(p, sp(ignore_eos=True, max_tokens=30)):
        break
    eng = llm.engine
    assert not eng.has_unfinished() and not eng.requests and eng.kv.usage() == 0.0
    eng.kv.check_invariants()
