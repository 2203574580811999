"""Checkpoint variants through the real loader, each against transformers on the same files: tied embeddings
(no lm_head tensor), Llama 3 RoPE scaling written the transformers 4.x way (rope_theta + rope_scaling), a
sharded checkpoint with model.safetensors.index.json."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ..conftest import hf_greedy, prompts

pytestmark = pytest.mark.integration
NEW = 8


def _compare(path, family):
    from layerzero.engine import LLM, SamplingParams
    from layerzero.testing.hf_models import load

    hf = load(family, path)
    ps = prompts(3, seed=41)
    outs = LLM(path, device="cpu", dtype=torch.float32, max_model_len=128, num_kv_blocks=64).generate(
        ps, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False
    )
    for p, o in zip(ps, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, NEW)[0]


def _copy(checkpoints, family, tmp_path):
    d = tmp_path / family
    shutil.copytree(checkpoints[family], d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_tied_embeddings(checkpoints, tmp_path):
    d = _copy(checkpoints, "qwen3", tmp_path)
    w = load_file(str(d / "model.safetensors"))
    w.pop("lm_head.weight")
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(d, tie_word_embeddings=True)
    _compare(d, "qwen3")


def test_llama3_rope_scaling_in_the_4x_format(checkpoints, tmp_path):
    d = _copy(checkpoints, "llama", tmp_path)
    _edit_config(
        d,
        rope_parameters=None,
        rope_theta=5000.0,
        max_position_embeddings=256,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    from layerzero.engine.config import ModelConfig

    cfg = ModelConfig.from_pretrained(d)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 5000.0
    _compare(d, "llama")


def test_sharded_checkpoint(checkpoints, tmp_path):
    from layerzero.engine.loader import safetensors_files
    from layerzero.testing.hf_models import load

    d = tmp_path / "sharded"
    model = load("qwen3_moe", checkpoints["qwen3_moe"])
    model.save_pretrained(str(d), max_shard_size="200KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoints["qwen3_moe"] / f, d / f)
    assert (d / "model.safetensors.index.json").is_file() and len(safetensors_files(d)) > 1
    _compare(d, "qwen3_moe")
