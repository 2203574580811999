"""Speculative decoding in the engine (float32, CPU): greedy speculative output equals plain greedy token for
token (the oracle: the same engine without speculation, itself checked against transformers in
test_hf_parity) for every model family and method (n-gram, draft model, layer skip), with batching, prefix
caching, chunked prefill and preemption; requests the verifier does not implement decode plainly in the same
batch (same tokens and logprobs as without speculation); seeded sampled requests give the same tokens alone
or in a batch; the acceptance counters and per-request metrics; bad configurations are typed errors."""

from __future__ import annotations

import pytest
import torch

import layerzero as lz

pytestmark = pytest.mark.integration

# repetitive prompts (n-gram drafts find matches), two sharing a 2-block prefix (prefix caching)
SHARED = [1, 40, 41, 42, 43, 44, 45, 46, 47]
PROMPTS = [
    [1, *([5, 6, 7, 8, 9] * 4)],
    [1, 20, 21, 22, 20, 21, 22, 20, 21],
    [*SHARED, 60, 61, 60, 61],
    [*SHARED, 70, 71, 72],
    [1, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102],
]
OPTS = dict(
    device="cpu",
    dtype=torch.float32,
    max_model_len=64,
    block_size=4,
    num_kv_blocks=30,  # < 5 sequences x 13-14 blocks: preemption
    max_num_batched_tokens=12,  # prompts prefill in chunks
    max_num_seqs=5,
)
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},  # the draft: the target itself
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 1},
}


def _greedy(max_tokens: int = 40):
    from layerzero.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(ckpt, spec=None, params=None, prompts=PROMPTS, as_decode=None, **kw):
    from layerzero.engine import LLM

    llm = LLM(ckpt, speculative_config=spec, **{**OPTS, **kw})
    runner = llm.engine.runner
    runner.verify_as_decode = as_decode
    prepare, llm.decode_verifications = runner.prepare, 0

    def spy(out, *args):
        batch = prepare(out, *args)
        llm.decode_verifications += batch.is_decode and any(out.spec_token_ids)
        return batch

    runner.prepare = spy
    outs = llm.generate(prompts, params or _greedy(), use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_greedy_speculative_output_equals_plain_greedy(checkpoints, family):
    ckpt = checkpoints[family]
    _, base = _run(ckpt)
    want = [o.outputs[0].token_ids for o in base]
    for name, spec in METHODS.items():
        spec = dict(spec, model=str(ckpt)) if name == "draft_model" else spec
        llm, outs = _run(
            ckpt, spec, async_scheduling=name == "ngram"
        )  # async: verification steps read at once
        assert [o.outputs[0].token_ids for o in outs] == want, name
        assert llm.decode_verifications == 0  # CPU default: verification chunks of k + 1 positions
        st = llm.engine.scheduler.spec.as_dict()
        assert st["num_drafts"] > 0 and st["num_accepted_tokens"] > 0, (name, st)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.kv.stats().hits > 0  # the shared prefix was served from the cache
        if name == "draft_model":  # draft = target: every draft is the target's argmax
            assert st["acceptance_rate"] > 0.95, st
        m = outs[0].spec_decode_metrics
        assert m is not None and m.num_draft_tokens >= m.num_accepted_tokens > 0


def _perturbed(ckpt, path, scale: float):
    """A copy of ``ckpt`` with Gaussian noise (``scale`` x each tensor's std) on every weight: a draft that
    agrees with the target often, not always."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, path)
    g = torch.Generator().manual_seed(5)
    w = load_file(str(path / "model.safetensors"))
    w = {k: (v + scale * v.std() * torch.randn(v.shape, generator=g)).contiguous() for k, v in w.items()}
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_verification_as_one_decode_row_per_position_changes_no_token(checkpoints):
    # the CUDA-graph form of a verification step (ModelRunner.verify_as_decode), forced on the CPU: each
    # verified position a decode row attending up to itself
    ckpt = checkpoints["qwen3"]
    _, base = _run(ckpt, max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in base]
    for name, spec in METHODS.items():
        spec = dict(spec, model=str(ckpt)) if name == "draft_model" else spec
        llm, outs = _run(ckpt, spec, as_decode=True, max_num_batched_tokens=64)
        assert [o.outputs[0].token_ids for o in outs] == want, name
        assert llm.engine.scheduler.spec.num_accepted_tokens > 0 and llm.decode_verifications > 5


def test_a_different_draft_model_is_rejected_often_and_changes_no_token(checkpoints, tmp_path):
    ckpt = checkpoints["qwen3"]
    draft = _perturbed(ckpt, tmp_path / "draft", 0.5)
    _, base = _run(ckpt, max_num_batched_tokens=64)
    llm, outs = _run(
        ckpt,
        {"method": "draft_model", "num_speculative_tokens": 4, "model": str(draft)},
        max_num_batched_tokens=64,
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    st = llm.engine.scheduler.spec.as_dict()
    assert 0 < st["num_accepted_tokens"] < st["num_draft_tokens"], st


def test_unsupported_rows_decode_plainly_in_the_same_batch_others_speculate(checkpoints):
    from layerzero.engine import SamplingParams

    ckpt = checkpoints["qwen3"]
    _, free = _run(ckpt, params=_greedy(16), prompts=[PROMPTS[4]], num_kv_blocks=80)
    banned = free[0].outputs[0].token_ids[3]  # row 4's bias bans a token its greedy output has
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),  # speculates
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={banned: -100.0, 11: 1.0}),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0, presence_penalty=0.1),
    ]
    spec = dict(METHODS["draft_model"], model=str(ckpt))
    _, base = _run(ckpt, params=params, prompts=[*PROMPTS, PROMPTS[0]], num_kv_blocks=80)
    llm, outs = _run(ckpt, spec, params=params, prompts=[*PROMPTS, PROMPTS[0]], num_kv_blocks=80)
    for a, b in zip(base, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-4
    for i in (1, 5):  # raw logprobs of verified (1) and plain (5) rows: the plain engine's
        lp_a, lp_b = base[i].outputs[0].logprobs, outs[i].outputs[0].logprobs
        assert len(lp_a) == len(lp_b) == 16
        for x, y in zip(lp_a, lp_b, strict=True):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) < 1e-5
    biased = outs[4].outputs[0].token_ids  # the bias shows (the verifier applied it at every position)
    assert banned not in biased and biased != free[0].outputs[0].token_ids
    skipped = llm.engine.scheduler.spec.skipped
    assert set(skipped) == {"penalties"}
    m = [o.spec_decode_metrics for o in outs]
    assert m[1].num_accepted_tokens > 0 and m[4].num_accepted_tokens > 0 and m[0].num_draft_tokens > 0
    assert m[2].num_draft_tokens == m[5].num_draft_tokens == 0 and m[3].num_draft_tokens > 0  # min_tokens


def test_seeded_sampled_requests_are_reproducible_alone_and_in_a_batch(checkpoints):
    from layerzero.engine import SamplingParams

    ckpt = checkpoints["llama"]
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(ckpt)}
    sp = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.02, seed=12, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True),  # unseeded: the engine's stream
    ]
    llm, together = _run(ckpt, spec, params=sp, prompts=PROMPTS[:3], num_kv_blocks=80)
    # the draft is the target and samples its drafts from the same warped distribution: q == p, so every
    # draft is accepted (greedy drafts would be accepted only with probability p(argmax))
    assert llm.engine.scheduler.spec.as_dict()["acceptance_rate"] > 0.97
    for i in (0, 1):
        _, alone = _run(ckpt, spec, params=sp[i], prompts=[PROMPTS[i]], num_kv_blocks=80)
        assert alone[0].outputs[0].token_ids == together[i].outputs[0].token_ids
    moved = SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    _, other = _run(ckpt, spec, params=moved, prompts=[PROMPTS[0]], num_kv_blocks=80)
    assert other[0].outputs[0].token_ids != together[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "keys"),
        ({"method": "ngram", "num_speculative_tokens": 2, "num_layers": 1}, "num_layers"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "min",
        ),
        ({"method": "layer_skip", "num_speculative_tokens": 2}, "num_layers"),
        ({"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 99}, "num_layers"),
        ("{not json", "JSON"),
    ],
)
def test_bad_speculative_configs_are_typed_errors(checkpoints, spec, match):
    from layerzero.engine import LLM

    with pytest.raises(lz.ConfigurationError, match=match):
        LLM(checkpoints["qwen3"], speculative_config=spec, **OPTS)


def test_a_draft_with_another_vocabulary_is_refused():
    from layerzero.engine.spec_decode import SpeculativeConfig

    cfg = SpeculativeConfig.from_any('{"method": "draft_model", "num_speculative_tokens": 2, "model": "d"}')
    cfg.check_model(4, 512, 512)
    with pytest.raises(lz.ConfigurationError, match="vocab_size"):
        cfg.check_model(4, 512, 1024)
    with pytest.raises(lz.ConfigurationError, match="tensor_parallel_size"):
        from layerzero.engine.config import EngineConfig

        EngineConfig("x", device="cpu", tensor_parallel_size=2, speculative_config=cfg)


def test_a_failed_verification_step_fails_its_requests_and_the_rest_roll_back(checkpoints, monkeypatch):
    ckpt = checkpoints["qwen3"]
    _, base = _run(ckpt, num_kv_blocks=80)
    from layerzero.engine import LLM

    llm = LLM(
        ckpt,
        speculative_config=METHODS["draft_model"] | {"model": str(ckpt)},
        **{**OPTS, "num_kv_blocks": 80},
    )
    runner = llm.engine.runner
    real, failed = runner.execute, []

    def fail_once(out, *args, **kwargs):
        if not failed and any(out.spec_token_ids):
            failed.append([r for r, d in zip(out.req_ids, out.spec_token_ids, strict=True) if d])
            raise RuntimeError("injected verification failure")
        return real(out, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_once)
    outs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert failed
    for o, b in zip(outs, base, strict=True):
        if o.outputs[0].finish_reason == "error":
            assert "injected verification failure" in o.error
        else:  # rolled back (preempted) and computed again: the same tokens
            assert o.outputs[0].token_ids == b.outputs[0].token_ids
    assert any(o.outputs[0].finish_reason == "error" for o in outs)
    assert any(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.kv.usage() == 0.0 and not llm.engine.has_unfinished()


def test_stops_inside_an_accepted_run_end_the_sequence_there(checkpoints):
    from layerzero.engine import SamplingParams

    ckpt = checkpoints["llama"]
    _, free = _run(ckpt, num_kv_blocks=80)
    # stop at a token each output has after a few tokens; max_tokens that end inside a run; n = 2; EOS live
    outs0 = [o.outputs[0].token_ids for o in free]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[outs0[0][7]]),
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[outs0[2][5]]),
        # a stop id the free output has at index 2, banned before min_tokens = 6 (the ban per position)
        SamplingParams(
            temperature=0.0, max_tokens=7, n=2, ignore_eos=True, stop_token_ids=[outs0[3][2]], min_tokens=6
        ),
        SamplingParams(temperature=0.0, max_tokens=25, prompt_logprobs=2),
    ]
    _, base = _run(ckpt, params=params, num_kv_blocks=80)
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(ckpt)}
    llm, outs = _run(ckpt, spec, params=params, num_kv_blocks=80)
    for a, b in zip(base, outs, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert (ca.token_ids, ca.finish_reason, ca.stop_reason) == (
                cb.token_ids,
                cb.finish_reason,
                cb.stop_reason,
            )
    assert outs[0].outputs[0].stop_reason == outs0[0][7] and len(outs[1].outputs[0].token_ids) == 11
    assert [len(c.token_ids) for c in outs[3].outputs] == [7, 7] or outs[3].outputs[0].stop_reason == outs0[
        3
    ][2]
    assert outs[3].outputs[0].token_ids[2] != outs0[3][2]  # the ban changed the third token
    assert outs[3].spec_decode_metrics.num_drafts > 0
    pa, pb = base[4].prompt_logprobs, outs[4].prompt_logprobs
    assert pa[0] is None and all(x.keys() == y.keys() for x, y in zip(pa[1:], pb[1:], strict=True))
    assert llm.engine.scheduler.spec.num_accepted_tokens > 0


def test_the_config_crosses_to_a_core_process_unchanged():
    from layerzero.engine.config import EngineConfig
    from layerzero.engine.core import serial

    for spec in (METHODS["ngram"], METHODS["layer_skip"], dict(METHODS["draft_model"], model="/d")):
        ec = EngineConfig("m", device="cpu", speculative_config=spec)
        back = serial.decode_config(serial.encode_config(ec)).speculative_config
        assert back == ec.speculative_config and back.method == spec["method"]
    assert (
        serial.decode_config(serial.encode_config(EngineConfig("m", device="cpu"))).speculative_config is None
    )


def test_structured_and_bad_words_rows_keep_their_constraints_in_a_verification_step(checkpoints):
    import re

    from layerzero.engine import SamplingParams
    from layerzero.engine.structured_params import StructuredOutputsParams

    ckpt = checkpoints["qwen3"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),  # speculates
        SamplingParams(
            temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-c]{3,8}")
        ),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words_token_ids=[[7, 8], [9]]),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8, 9]),
    ]
    prompts = PROMPTS[:4]
    _, base = _run(ckpt, params=params, prompts=prompts, num_kv_blocks=80)
    llm, outs = _run(ckpt, METHODS["ngram"], params=params, prompts=prompts, num_kv_blocks=80)
    for a, b in zip(base, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert re.fullmatch("[a-c]{3,8}", outs[1].outputs[0].text)
    assert 9 not in outs[2].outputs[0].token_ids and set(outs[3].outputs[0].token_ids) <= {5, 6, 7, 8, 9}
    assert outs[0].spec_decode_metrics.num_drafts > 0 and outs[1].spec_decode_metrics.num_drafts == 0
    assert llm.decode_verifications == 0


def test_logits_processor_plugins_with_speculation_are_refused():
    from layerzero.engine.config import EngineConfig
    from layerzero.engine.logits_processors import ForceTokenLogitsProcessor

    with pytest.raises(lz.ConfigurationError, match="logits_processors"):
        EngineConfig(
            "m",
            device="cpu",
            speculative_config=METHODS["ngram"],
            logits_processors=[ForceTokenLogitsProcessor],
        )
