"""``SamplingParams.prompt_logprobs`` against an oracle independent of the engine: transformers' forward of
the same tiny checkpoint in float64 (float32 for the MoE), log-softmax at each position. Each prompt token's
logprob within 1e-4 of the oracle (the engine runs float32), and the top-N ids the oracle's (ties aside), for
a short prompt, a prompt longer than ``max_num_batched_tokens`` (chunked prefill, both scheduling modes), a
prompt whose prefix is cached (the request recomputes it), ``n=2``, ``prompt_logprobs=0``, a batch mixing
such a request with normal ones, a pool small enough to preempt, and a stream (the first delta only)."""

from __future__ import annotations

import copy

import pytest
import torch

from ..conftest import FAMILIES, deadline, prompts

pytestmark = pytest.mark.integration
TOL = 1e-4  # float32 engine against the float64 oracle


def _llm(path, **kw):
    from layerzero.engine import LLM

    opts = dict(device="cpu", dtype=torch.float32, max_model_len=128, num_kv_blocks=96, max_num_seqs=8)
    opts.update(kw)
    return LLM(path, **opts)


def _params(n_top, **kw):
    from layerzero.engine import SamplingParams

    kw.setdefault("max_tokens", 4)
    return SamplingParams(temperature=0.0, ignore_eos=True, prompt_logprobs=n_top, **kw)


_ORACLES: dict[int, object] = {}


def _oracle(hf_model, prompt: list[int]) -> torch.Tensor:
    """``[P, V]`` float64: row j - 1 is log p(token j | tokens < j) for every token (transformers' forward in
    float64; in float32 where transformers cannot run float64, its MoE's grouped GEMM, as test_hf_parity)."""
    key = id(hf_model)
    if key not in _ORACLES:
        _ORACLES[key] = copy.deepcopy(hf_model).double()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        try:
            logits = _ORACLES[key](ids).logits[0]
        except RuntimeError:  # "Expected mat_a to be Float32, BFloat16 or Float16" (torch._grouped_mm)
            _ORACLES[key] = hf_model
            logits = hf_model(ids).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_prompt_logprobs(hf_model, prompt: list[int], got, n_top: int) -> None:
    """``got`` (``RequestOutput.prompt_logprobs``) against the oracle: one entry per prompt token, the first
    None; each entry the top ``n_top`` and the prompt token, every value within TOL; every id the oracle ranks
    clearly above its N-th value is there (ties at the boundary may go either way)."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = _oracle(hf_model, prompt)
    for j in range(1, len(prompt)):
        d, row, tok = got[j], ref[j - 1], prompt[j]
        assert tok in d and abs(d[tok] - row[tok].item()) < TOL, (j, d.get(tok), row[tok].item())
        for t, v in d.items():
            assert abs(v - row[t].item()) < TOL, (j, t, v, row[t].item())
        top = [t for t in d if t != tok] if len(d) > n_top else list(d)
        assert len(top) == n_top and len(d) in (n_top, n_top + 1), (j, d)
        if n_top:
            vals, ids = row.topk(n_top)
            cut = vals[-1].item()
            assert set(ids[vals > cut + TOL].tolist()) <= set(d), (j, d, ids.tolist())
            assert all(row[t].item() >= cut - TOL for t in top), (j, d)


@pytest.mark.parametrize("family", FAMILIES)
def test_short_prompt_matches_transformers(family, checkpoints, hf_models):
    p = prompts(1, seed=11, lo=12, hi=12)[0]
    (o,) = _llm(checkpoints[family]).generate([p], _params(5), use_tqdm=False)
    assert_prompt_logprobs(hf_models[family], p, o.prompt_logprobs, 5)
    assert len(o.outputs) == 1 and len(o.outputs[0].token_ids) == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_accumulates_across_chunks(async_scheduling, checkpoints, hf_models):
    """A 70-token prompt in 16-token chunks: each chunk's last position predicts the next chunk's first
    token; the tokens equal an unchunked run's."""
    p = prompts(1, seed=12, lo=70, hi=70)[0]
    kw = dict(max_num_batched_tokens=16, async_scheduling=async_scheduling)
    (o,) = _llm(checkpoints["qwen3"], **kw).generate([p], _params(3, max_tokens=6), use_tqdm=False)
    assert_prompt_logprobs(hf_models["qwen3"], p, o.prompt_logprobs, 3)
    (ref,) = _llm(checkpoints["qwen3"]).generate([p], _params(None, max_tokens=6), use_tqdm=False)
    assert o.outputs[0].token_ids == ref.outputs[0].token_ids and ref.prompt_logprobs is None


@pytest.mark.parametrize("prefix_cache", ["radix", "hash"])
def test_cached_prefix_is_recomputed(prefix_cache, checkpoints, hf_models):
    """Prefix caching on, the same prompt again: a request with prompt_logprobs takes no cache hit (its prompt
    is computed, so every position has logits); one without still hits the cache."""
    p = prompts(1, seed=13, lo=50, hi=50)[0]
    llm = _llm(checkpoints["qwen3"], enable_prefix_caching=True, prefix_cache=prefix_cache, block_size=16)
    (first,) = llm.generate([p], _params(None), use_tqdm=False)
    (again,) = llm.generate([p], _params(2), use_tqdm=False)
    (third,) = llm.generate([p], _params(None), use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0 and third.num_cached_tokens == 48
    assert_prompt_logprobs(hf_models["qwen3"], p, again.prompt_logprobs, 2)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == third.outputs[0].token_ids
    (ext,) = llm.generate([p + [7, 8, 9]], _params(2), use_tqdm=False)  # a longer prompt over the cached one
    assert ext.num_cached_tokens == 0
    assert_prompt_logprobs(hf_models["qwen3"], p + [7, 8, 9], ext.prompt_logprobs, 2)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n2_shares_one_prompt_logprobs(prefix_caching, checkpoints, hf_models):
    p = prompts(1, seed=14, lo=40, hi=40)[0]
    llm = _llm(checkpoints["qwen3"], enable_prefix_caching=prefix_caching, max_num_batched_tokens=32)
    params = _params(4, n=2, max_tokens=5)
    (o,) = llm.generate([p], params, use_tqdm=False)
    assert [c.index for c in o.outputs] == [0, 1] and all(len(c.token_ids) == 5 for c in o.outputs)
    assert_prompt_logprobs(hf_models["qwen3"], p, o.prompt_logprobs, 4)
    # with prefix caching the second completion starts once the first computed the prompt (and its logprobs):
    # it reuses the cached blocks; without, each computes the prompt
    assert o.num_cached_tokens == (32 if prefix_caching else 0)
    deltas = list(llm.stream(p, params))
    assert deltas[0].prompt_logprobs == o.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:]) and len(deltas) > 1


def test_prompt_logprobs_zero_gives_only_the_prompt_token(checkpoints, hf_models):
    p = prompts(1, seed=15, lo=20, hi=20)[0]
    (o,) = _llm(checkpoints["llama"]).generate([p], _params(0), use_tqdm=False)
    assert all(set(d) == {t} for d, t in zip(o.prompt_logprobs[1:], p[1:], strict=True))
    assert_prompt_logprobs(hf_models["llama"], p, o.prompt_logprobs, 0)


def test_one_token_prompt(checkpoints):
    (o,) = _llm(checkpoints["qwen3"]).generate([[1]], _params(3), use_tqdm=False)
    assert o.prompt_logprobs == [None] and len(o.outputs[0].token_ids) == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_alongside_normal_requests_in_one_batch(async_scheduling, checkpoints, hf_models):
    """Requests with and without prompt logprobs (sampled, logprobs, chunked) in the same steps: each asking
    one matches the oracle, the others have none, and every request's tokens equal its run alone."""
    from layerzero.engine import SamplingParams

    ps = prompts(4, seed=16, lo=20, hi=45)
    params = [
        _params(2, max_tokens=5),
        SamplingParams(temperature=0.8, seed=3, max_tokens=5, logprobs=2, ignore_eos=True),
        _params(6, max_tokens=5, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    kw = dict(max_num_batched_tokens=48, async_scheduling=async_scheduling)
    llm = _llm(checkpoints["qwen3"], **kw)
    outs = llm.generate(ps, params, use_tqdm=False)
    for p, sp, o in zip(ps, params, outs, strict=True):
        if sp.prompt_logprobs is None:
            assert o.prompt_logprobs is None
        else:
            assert_prompt_logprobs(hf_models["qwen3"], p, o.prompt_logprobs, sp.prompt_logprobs)
        (alone,) = _llm(checkpoints["qwen3"], **kw).generate([p], sp, use_tqdm=False)
        assert o.outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_a_small_pool(async_scheduling, checkpoints, hf_models):
    """A pool that cannot hold every sequence: preempted requests recompute, their prompt logprobs are still
    the oracle's and sent once."""
    ps = prompts(6, seed=17, lo=30, hi=60)
    kw = dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    llm = _llm(checkpoints["qwen3"], **kw)
    with deadline(120):
        outs = llm.generate(ps, _params(1, max_tokens=24, n=2), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs, strict=True):
        assert_prompt_logprobs(hf_models["qwen3"], p, o.prompt_logprobs, 1)
        assert all(len(c.token_ids) == 24 for c in o.outputs)


def test_logits_computed_a_few_rows_at_a_time(checkpoints, hf_models, monkeypatch):
    """The prompt rows' LM head and log-softmax run in slices (bounded memory): slices of 3 rows give the
    oracle's values too."""
    from layerzero.engine.worker import prompt_logprobs

    llm = _llm(checkpoints["qwen3"])
    monkeypatch.setattr(prompt_logprobs, "SLICE_ELEMENTS", 3 * llm.engine.model_config.vocab_size)
    p = prompts(1, seed=18, lo=23, hi=23)[0]
    (o,) = llm.generate([p], _params(2), use_tqdm=False)
    assert_prompt_logprobs(hf_models["qwen3"], p, o.prompt_logprobs, 2)
