"""``LLM.beam_search`` against transformers' ``generate(num_beams=W, do_sample=False, length_penalty=L)``:
the same W hypotheses in the same order and the same ``sequences_scores``, for several (W, L), with and
without EOS ending hypotheses, on two model families (tiny float32 checkpoints); the beams' shared prefix is
not computed again (copy-on-write forks: ``test_beam_fork.py``)."""

from __future__ import annotations

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration


def _llm(path):
    from layerzero.engine import LLM

    return LLM(path, device="cpu", dtype=torch.float32, max_model_len=48, num_kv_blocks=256, block_size=4)


def _hf(model, prompt, w, length_penalty, max_new_tokens, eos):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=w,
        do_sample=False,
        length_penalty=length_penalty,
        num_return_sequences=w,
        output_scores=True,
        return_dict_in_generate=True,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos,
        early_stopping=False,
    )
    return out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()


def _check(llm, hf, prompt, w, lp, t, eos):
    from layerzero.engine import BeamSearchParams

    want, scores = _hf(hf, prompt, w, lp, t, eos)
    (got,) = llm.beam_search([prompt], BeamSearchParams(beam_width=w, max_tokens=t, length_penalty=lp))
    assert len(got.sequences) == w
    for seq, ref, ref_score in zip(got.sequences, want, scores, strict=True):
        out = seq.output_tokens
        assert seq.tokens[: len(prompt)] == prompt
        # transformers pads shorter hypotheses (with the EOS as pad here)
        assert ref[: len(out)] == out and all(x == eos for x in ref[len(out) :]), (out, ref)
        assert seq.score == pytest.approx(ref_score, abs=1e-4)
        n = len(out)
        assert seq.cum_logprob == pytest.approx(seq.score * n**lp, abs=1e-4 * n**lp)
        assert seq.finish_reason == ("stop" if out[-1] == eos else "length")
    return got


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_beam_search_equals_transformers(checkpoints, hf_models, family, monkeypatch):
    llm, hf = _llm(checkpoints[family]), hf_models[family]
    prompt = prompts(1, seed=51, lo=7, hi=7)[0]
    eos = llm.input_processor.eos_token_id
    for w, lp in ((2, 1.0), (3, 0.5), (4, 2.0)):
        _check(llm, hf, prompt, w, lp, 6, eos)
    stats = llm.engine.kv.stats()
    assert stats.hits > 0  # the beams' prefix blocks came from the prefix cache
    # EOS handling: make a token the search meets the EOS (engine and transformers alike), so hypotheses
    # end early and the early-stop heuristic decides when the search is done
    (free,) = llm.beam_search([prompt], _params(4, 6))
    for eos_tok in (free.sequences[1].output_tokens[2], free.sequences[0].output_tokens[0]):
        monkeypatch.setattr(llm.engine, "eos", {eos_tok})
        monkeypatch.setattr(llm.input_processor, "eos_token_id", eos_tok)
        stopped = 0
        for w, lp in ((3, 1.0), (4, 0.0), (2, 2.0)):
            got = _check(llm, hf, prompt, w, lp, 8, eos_tok)
            stopped += sum(s.finish_reason == "stop" for s in got.sequences)
        assert stopped > 0


def _params(w, t, **kw):
    from layerzero.engine import BeamSearchParams

    return BeamSearchParams(beam_width=w, max_tokens=t, **kw)


def test_ignore_eos_and_bad_params(checkpoints):
    from layerzero import InvalidInputError
    from layerzero.engine import BeamSearchParams

    llm = _llm(checkpoints["qwen3"])
    prompt = prompts(1, seed=52, lo=5, hi=5)[0]
    (out,) = llm.beam_search([{"prompt_token_ids": prompt}], _params(2, 4, ignore_eos=True))
    assert all(len(s.output_tokens) == 4 and s.finish_reason == "length" for s in out.sequences)
    assert out.sequences[0].score >= out.sequences[1].score
    assert out.sequences[0].text == llm.tokenizer.decode(out.sequences[0].tokens)
    for kw in ({"beam_width": 0}, {"beam_width": 11}, {"max_tokens": 0}, {"temperature": 0.7}):
        with pytest.raises(InvalidInputError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
    with pytest.raises(InvalidInputError, match="max_model_len"):
        llm.beam_search([prompt], _params(2, 46))
    with pytest.raises(InvalidInputError):
        llm.beam_search([prompt], {"beam_width": 2})


def test_several_prompts_in_one_call_equal_each_alone(checkpoints, hf_models):
    llm, hf = _llm(checkpoints["llama"]), hf_models["llama"]
    ps = prompts(3, seed=53, lo=3, hi=9)
    both = llm.beam_search(ps, _params(3, 5, length_penalty=0.7))
    eos = llm.input_processor.eos_token_id
    for p, got in zip(ps, both, strict=True):
        (alone,) = llm.beam_search([p], _params(3, 5, length_penalty=0.7))
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]
        assert [s.score for s in got.sequences] == pytest.approx([s.score for s in alone.sequences], abs=1e-5)
    _check(llm, hf, ps[2], 3, 0.7, 5, eos)


def test_early_stop_heuristic_matches_transformers(checkpoints, hf_models, monkeypatch):
    """A case where transformers' ``early_stopping=False`` heuristic ends the search before ``max_tokens``
    (found by search on this checkpoint; the step count proves the heuristic fired): a beam that would
    finish later with a better score is not added, in both implementations."""
    llm, hf = _llm(checkpoints["qwen3"]), hf_models["qwen3"]
    prompt = prompts(1, seed=53, lo=7, hi=7)[0]
    eos = 69
    monkeypatch.setattr(llm.engine, "eos", {eos})
    monkeypatch.setattr(llm.input_processor, "eos_token_id", eos)
    from layerzero.engine import beam_search as bs

    calls = []
    step = bs._CoreSteps.step
    monkeypatch.setattr(bs._CoreSteps, "step", lambda self, *a: calls.append(1) or step(self, *a))
    for w in (2, 3):
        calls.clear()
        _check(llm, hf, prompt, w, 1.0, 8, eos)
        assert 0 < len(calls) < 8  # stopped early


def test_beams_recompute_at_most_a_block_per_step(checkpoints, monkeypatch):
    """What docs/decoding.md says is shared: after the first step, no beam request computes more than
    ``block_size`` tokens (counted with the prefix cache's lookups; since the copy-on-write forks only the
    first step looks any up, and each later step computes one token per beam: ``test_beam_fork.py``)."""
    from layerzero.engine import beam_search as bs

    llm = _llm(checkpoints["llama"])
    prompt = prompts(1, seed=54, lo=9, hi=9)[0]
    llm.beam_search([[1, 2, 3]], _params(2, 2))  # warm: nothing of ``prompt`` is cached
    sizes = []
    step = bs._CoreSteps.step
    monkeypatch.setattr(
        bs._CoreSteps, "step", lambda self, reqs, k: sizes.append(len(reqs)) or step(self, reqs, k)
    )
    before = llm.engine.kv.stats()
    (out,) = llm.beam_search([prompt], _params(3, 10, ignore_eos=True))
    after = llm.engine.kv.stats()
    computed = (after.queries - before.queries) - (after.hits - before.hits)
    block = 4
    assert sizes[0] == 1 and len(sizes) == 10
    assert computed <= len(prompt) + block * sum(sizes[1:])
    every = sum(n * (len(prompt) + i) for i, n in enumerate(sizes))  # tokens without any sharing
    assert computed < every / 4
    assert len(out.sequences) == 3
