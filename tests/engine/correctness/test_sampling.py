"""Sampling through the engine: seeded requests give the same tokens alone or in any batch; sampled tokens
stay inside the top-k / top-p set (checked against the raw logprobs the engine returns); the empirical
distribution of many draws matches transformers' warped softmax (cosine >= 0.99)."""

from __future__ import annotations

import math

import pytest
import torch

from ..conftest import prompts

pytestmark = pytest.mark.integration
FAMILY = "qwen3"


@pytest.fixture(scope="module")
def llm(checkpoints):
    from layerzero.engine import LLM

    return LLM(
        checkpoints[FAMILY],
        device="cpu",
        dtype=torch.float32,
        max_model_len=64,
        num_kv_blocks=256,
        max_num_seqs=64,
    )


def sp(**kw):
    from layerzero.engine import SamplingParams

    kw.setdefault("max_tokens", 8)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def test_seeded_request_is_the_same_alone_and_in_any_batch(llm):
    target = prompts(1, seed=31, lo=9, hi=9)[0]
    others = prompts(5, seed=32)
    params = sp(temperature=0.9, top_p=0.95, seed=1234)
    (alone,) = llm.generate([target], params, use_tqdm=False)
    mixed = llm.generate(
        [*others[:2], target, *others[2:]],
        [sp(temperature=1.0), sp(temperature=0.0), params, sp(seed=5), sp(top_k=3), sp(min_p=0.2)],
        use_tqdm=False,
    )
    assert mixed[2].outputs[0].token_ids == alone.outputs[0].token_ids
    (other_seed,) = llm.generate([target], sp(temperature=0.9, top_p=0.95, seed=1235), use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_completions_differ_and_each_is_reproducible(llm):
    p = prompts(1, seed=33, lo=6, hi=6)[0]
    (a,) = llm.generate([p], sp(n=3, temperature=1.0, seed=9), use_tqdm=False)
    (b,) = llm.generate([p], sp(n=3, temperature=1.0, seed=9), use_tqdm=False)
    ta = [c.token_ids for c in a.outputs]
    assert ta == [c.token_ids for c in b.outputs] and len({tuple(t) for t in ta}) == 3
    assert [c.index for c in a.outputs] == [0, 1, 2]


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_tokens_are_among_the_k_most_likely(llm, k):
    ps = prompts(6, seed=34)
    outs = llm.generate(ps, sp(temperature=1.0, top_k=k, logprobs=k, max_tokens=6), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert len(lp) == k and tok in lp  # the chosen token is one of the top k (no extra entry)


def test_top_p_tokens_are_inside_the_nucleus(llm):
    ps = prompts(6, seed=35)
    outs = llm.generate(ps, sp(temperature=1.0, top_p=0.6, logprobs=20, max_tokens=6), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:20]
            before = sum(math.exp(v) for t, v in ranked if v > lp[tok])
            assert before < 0.6 + 1e-6  # the mass of strictly likelier tokens is below p


def test_distribution_of_the_first_token_matches_transformers(llm, hf_models):
    p = prompts(1, seed=36, lo=7, hi=7)[0]
    temperature, top_k = 1.3, 40
    (o,) = llm.generate([p], sp(n=1500, temperature=temperature, top_k=top_k, max_tokens=1), use_tqdm=False)
    counts = torch.zeros(512, dtype=torch.float64)
    for c in o.outputs:
        counts[c.token_ids[0]] += 1
    with torch.no_grad():
        logits = hf_models[FAMILY](torch.tensor([p])).logits[0, -1].double() / temperature
    cut = logits.topk(top_k).values[-1]
    target = torch.softmax(logits.masked_fill(logits < cut, -math.inf), -1)
    assert torch.nn.functional.cosine_similarity(counts, target, dim=0) >= 0.99
    assert counts[target == 0].sum() == 0


@pytest.mark.parametrize("caching", [True, False])
def test_n_greedy_completions_share_the_prompt_blocks(checkpoints, caching):
    from layerzero.engine import LLM

    llm = LLM(
        checkpoints[FAMILY],
        device="cpu",
        dtype=torch.float32,
        max_model_len=64,
        num_kv_blocks=64,
        enable_prefix_caching=caching,
    )
    p = prompts(1, seed=37, lo=40, hi=40)[0]
    (o,) = llm.generate([p], sp(n=3, temperature=0.0, logprobs=0), use_tqdm=False)
    (one,) = llm.generate([p], sp(temperature=0.0), use_tqdm=False)
    assert all(c.token_ids == one.outputs[0].token_ids for c in o.outputs)
    assert o.num_cached_tokens == (32 if caching else 0)  # siblings reuse the 2 full blocks of 16
