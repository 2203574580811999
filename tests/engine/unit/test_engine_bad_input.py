"""Every bad engine input gets a typed LayerZero error before anything is scheduled, and requests already in
the engine are not lost."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import layerzero as lz

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llm(checkpoints):
    from layerzero.engine import LLM

    return LLM(checkpoints["qwen3"], device="cpu", dtype=torch.float32, max_model_len=48, num_kv_blocks=32)


BAD_PARAMS = [
    dict(temperature=-0.1),
    dict(temperature=math.nan),
    dict(temperature=math.inf),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(top_k=-2),
    dict(top_k=1.5),
    dict(min_p=-0.1),
    dict(min_p=2.0),
    dict(repetition_penalty=0.0),
    dict(repetition_penalty=math.nan),
    dict(presence_penalty=3.0),
    dict(frequency_penalty=-2.5),
    dict(max_tokens=0),
    dict(max_tokens=-1),
    dict(min_tokens=-1),
    dict(min_tokens=20, max_tokens=10),
    dict(n=0),
    dict(logprobs=21),
    dict(logprobs=-1),
    dict(seed=-1),
    dict(stop=""),
    dict(stop=[1]),
    dict(stop_token_ids=[-1]),
    dict(logit_bias={3: math.nan}),
    dict(logit_bias={-1: 1.0}),
    dict(logit_bias=[1]),
    dict(ignore_eos="yes"),
    dict(temperature=True),
]


@pytest.mark.parametrize("kw", BAD_PARAMS, ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_bad_sampling_params_raise_invalid_input(kw):
    from layerzero.engine import SamplingParams

    with pytest.raises(lz.InvalidInputError, match="SamplingParams"):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "prompt,match",
    [
        ([], "at least one token"),
        ("", "at least one token"),
        ([1, 512], r"\[0, 512\)"),
        ([1, -3], r"\[0, 512\)"),
        ([1, 2.0], "int"),
        ([1] * 49, "max_model_len"),
        (None, "string or a list"),
        ([True], "int"),
    ],
)
def test_bad_prompts_raise_before_anything_is_queued(llm, prompt, match):
    from layerzero.engine import SamplingParams

    with pytest.raises(lz.InvalidInputError, match=match):
        llm.generate([[1, 5, 6], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kw", [dict(logit_bias={512: 1.0}), dict(stop_token_ids=[7, 600])])
def test_token_ids_outside_the_vocabulary(llm, kw):
    from layerzero.engine import SamplingParams

    with pytest.raises(lz.InvalidInputError, match="vocab size 512"):
        llm.generate([[1, 5, 6]], SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_bad_request_does_not_lose_a_running_one(llm):
    from layerzero.engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (alone,) = llm.generate([[1, 9, 8, 7]], sp, use_tqdm=False)
    stream = llm.stream([1, 9, 8, 7], sp)
    first = next(stream)
    with pytest.raises(lz.InvalidInputError):
        llm.generate([[1, 2], [1, 10_000]], sp, use_tqdm=False)
    rest = list(stream)
    tokens = [t for d in [first, *rest] for t in d.outputs[0].token_ids]
    assert tokens == alone.outputs[0].token_ids and rest[-1].finished


def test_mismatched_parameter_lists(llm):
    from layerzero.engine import SamplingParams

    with pytest.raises(lz.InvalidInputError, match="one per prompt"):
        llm.generate([[1, 2], [1, 3]], [SamplingParams()] * 3, use_tqdm=False)


def test_unsupported_architecture_lists_the_supported_ones(checkpoints, tmp_path):
    from layerzero.engine import LLM

    d = tmp_path / "gpt2"
    shutil.copytree(checkpoints["qwen3"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(lz.ConfigurationError, match="llama.*qwen3.*qwen3_moe"):
        LLM(d, device="cpu")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=0), "block_size"),
        (dict(kv_cache_memory_fraction=0.0), "kv_cache_memory_fraction"),
        (dict(prefix_cache="lru"), "prefix_cache"),
        (dict(scheduling_policy="sjf"), "scheduling_policy"),
        (dict(dtype=torch.int8), "dtype"),
        (dict(num_kv_blocks=2, max_model_len=48), "KV cache size"),
        (dict(max_model_len=10_000), "max_position"),
        (dict(device="nope"), "device"),
    ],
)
def test_bad_engine_options(checkpoints, kw, match):
    from layerzero.engine import LLM

    with pytest.raises(lz.ConfigurationError, match=match):
        LLM(checkpoints["qwen3"], **{"device": "cpu", **kw})


def test_missing_or_incomplete_checkpoint(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from layerzero.engine import LLM

    with pytest.raises(lz.ConfigurationError, match="config.json"):
        LLM(tmp_path, device="cpu")
    d = tmp_path / "partial"
    shutil.copytree(checkpoints["qwen3"], d)
    weights = load_file(str(d / "model.safetensors"))
    weights.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(lz.ConfigurationError, match="qkv_proj"):
        LLM(d, device="cpu", max_model_len=48, num_kv_blocks=8)


def test_a_bad_priority_in_a_batch_queues_nothing(llm):
    from layerzero.engine import SamplingParams

    with pytest.raises(lz.InvalidInputError, match="priority"):
        llm.generate([[1, 5], [1, 6]], SamplingParams(max_tokens=2), priority=[0, "high"], use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
