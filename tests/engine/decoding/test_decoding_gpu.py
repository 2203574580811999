"""Issue 39 section 4 on a GPU: token restrictions and a logits-processor plugin in a mixed batch with CUDA
graphs (greedy rows keep the greedy decode graph, restricted / processed rows go through the sampler with
staged index tensors), and beam search in float32 against transformers."""

from __future__ import annotations

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.gpu
FORCE = "layerzero.engine.logits_processors:ForceTokenLogitsProcessor"


def _sp(**kw):
    from layerzero.engine import SamplingParams

    kw.setdefault("max_tokens", 12)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def _contains(seq, word):
    k = len(word)
    return any(tuple(seq[i : i + k]) == tuple(word) for i in range(len(seq) - k + 1))


@pytest.mark.parametrize("procs", [(), (FORCE,)], ids=["no-plugin", "plugin"])
def test_restrictions_and_plugin_in_a_mixed_batch_on_cuda(checkpoints, procs):
    from layerzero.engine import LLM

    llm = LLM(
        checkpoints["qwen3"],
        device="cuda",
        dtype=torch.bfloat16,
        max_model_len=64,
        num_kv_blocks=128,
        max_num_seqs=16,
        logits_processors=list(procs),
    )
    ps = prompts(6, seed=81, lo=4, hi=12)
    free = llm.generate(ps, [_sp(temperature=0.0)] * 6, use_tqdm=False)
    t = free[2].outputs[0].token_ids
    words = [[t[0]], [t[3], t[4]]]
    params = [
        _sp(temperature=0.0),
        _sp(temperature=1.0, seed=1, allowed_token_ids=[5, 17, 99]),
        _sp(temperature=0.0, bad_words_token_ids=words),
        _sp(temperature=0.8, seed=2, top_k=5, bad_words_token_ids=words),
        _sp(temperature=0.0, extra_args={"force_token_id": 7}),
        _sp(temperature=0.0, logprobs=3),
    ]
    outs = llm.generate(ps, params, use_tqdm=False)
    tok = [o.outputs[0].token_ids for o in outs]
    assert tok[0] == free[0].outputs[0].token_ids and tok[5] == free[5].outputs[0].token_ids
    assert set(tok[1]) <= {5, 17, 99}
    for i in (2, 3):
        assert not any(_contains(tok[i], w) for w in words), tok[i]
    if procs:
        assert tok[4] == [7] * 12
    else:
        assert tok[4] == free[4].outputs[0].token_ids


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_beam_search_fp32_cuda_equals_transformers(checkpoints, hf_models, family):
    from layerzero.engine import LLM, BeamSearchParams

    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(checkpoints[family], device="cuda", dtype=torch.float32, max_model_len=48, num_kv_blocks=256)
    hf = hf_models[family]
    prompt = prompts(1, seed=82, lo=8, hi=8)[0]
    eos = llm.input_processor.eos_token_id
    for w, lp in ((2, 1.0), (4, 0.5)):
        (got,) = llm.beam_search([prompt], BeamSearchParams(beam_width=w, max_tokens=8, length_penalty=lp))
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=w,
            do_sample=False,
            length_penalty=lp,
            num_return_sequences=w,
            output_scores=True,
            return_dict_in_generate=True,
            max_new_tokens=8,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        for seq, r, s in zip(
            got.sequences, ref.sequences.tolist(), ref.sequences_scores.tolist(), strict=True
        ):
            out = seq.output_tokens
            assert r[len(prompt) : len(prompt) + len(out)] == out
            assert seq.score == pytest.approx(s, abs=1e-3)
