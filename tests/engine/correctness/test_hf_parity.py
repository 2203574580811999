"""The engine against Hugging Face transformers on the same checkpoint (float32, CPU): greedy tokens equal,
raw logprobs within 1e-4, for Qwen3, Llama and Qwen3-MoE, a batch of ragged prompts."""

from __future__ import annotations

import pytest
import torch

from ..conftest import FAMILIES, hf_greedy, prompts

pytestmark = pytest.mark.integration
NEW_TOKENS = 12


def _llm(path, **kw):
    from layerzero.engine import LLM

    opts = dict(device="cpu", dtype=torch.float32, max_model_len=128, num_kv_blocks=96, max_num_seqs=8)
    opts.update(kw)
    return LLM(path, **opts)


def _greedy(**kw):
    from layerzero.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, **kw)


def _hf_like(**kw):
    """transformers' generate(min_new_tokens=N) bans EOS for N tokens: the engine's min_tokens=N does the
    same."""
    return _greedy(min_tokens=NEW_TOKENS, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_match_transformers(family, checkpoints, hf_models):
    ps = prompts(5, seed=1)
    outs = _llm(checkpoints[family]).generate(ps, _greedy(), use_tqdm=False)
    for p, o in zip(ps, outs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf_models[family], p, NEW_TOKENS)
        c = o.outputs[0]
        assert c.token_ids == ref_tokens
        ours = [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps, strict=True)) < 1e-4
        assert c.finish_reason == "length" and o.prompt_token_ids == p


def test_text_prompt_is_tokenized_like_transformers(checkpoints, hf_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoints["qwen3"]))
    text = "The quick brown fox jumps over a lazy dog"
    (o,) = _llm(checkpoints["qwen3"]).generate([text], _greedy(), use_tqdm=False)
    ids = tok(text)["input_ids"]
    assert o.prompt_token_ids == ids and o.prompt == text
    ref, _ = hf_greedy(hf_models["qwen3"], ids, NEW_TOKENS)
    assert o.outputs[0].token_ids == ref
    # a byte-level BPE: the text is the decoded output, less an incomplete UTF-8 sequence at the very end
    # (the stream holds it back, as vLLM's detokenizer does; transformers shows it as U+FFFD)
    assert o.outputs[0].text == tok.decode(ref, skip_special_tokens=True).rstrip("\ufffd")


def test_repetition_penalty_matches_transformers(checkpoints, hf_models):
    p = prompts(1, seed=5, lo=12, hi=12)[0]
    (o,) = _llm(checkpoints["qwen3"]).generate([p], _hf_like(repetition_penalty=1.7), use_tqdm=False)
    with torch.no_grad():
        ref = hf_models["qwen3"].generate(
            torch.tensor([p]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            repetition_penalty=1.7,
            pad_token_id=0,
        )
    assert o.outputs[0].token_ids == ref[0, len(p) :].tolist()


def test_logit_bias_matches_transformers_sequence_bias(checkpoints, hf_models):
    p = prompts(1, seed=6, lo=9, hi=9)[0]
    free, _ = hf_greedy(hf_models["qwen3"], p, NEW_TOKENS)
    bias = {free[0]: -50.0, 77: 8.0}
    (o,) = _llm(checkpoints["qwen3"]).generate([p], _hf_like(logit_bias=bias), use_tqdm=False)
    with torch.no_grad():
        ref = hf_models["qwen3"].generate(
            torch.tensor([p]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            sequence_bias={(t,): b for t, b in bias.items()},
        )
    assert o.outputs[0].token_ids == ref[0, len(p) :].tolist()
    assert o.outputs[0].token_ids[0] != free[0]
