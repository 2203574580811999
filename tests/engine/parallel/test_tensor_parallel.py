"""Tensor parallelism in the model (issue 38), on CPU over Gloo: each parallel layer at tp 2 and 3 (odd sizes,
float64) against the full layer, and whole models at tp 2 (real tiny safetensors checkpoints, paged KV, one
prefill and one decode step) against the tp 1 model within 1e-4 in float32: Qwen3, a Llama whose one KV head
is replicated (tp > num_kv_heads; attention bias, tied embeddings), Qwen3-MoE with experts' intermediate size
split (ep False) and with experts partitioned (ep True). The single-process tests need no peer: sharded
loading, per-rank dummy weights, the typed refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import layerzero as lz
from layerzero.engine.config import ModelConfig
from layerzero.engine.layers.quantized_linear import quantize_model
from layerzero.engine.loader import load_dummy_weights, load_model_weights
from layerzero.engine.models.llama import check_tensor_parallel
from layerzero.engine.models.registry import build_model
from layerzero.engine.parallel import comm
from layerzero.engine.parallel.layers import ColumnParallelLinear
from layerzero.engine.parallel.state import SINGLE, ParallelState

from ._tp_harness import model_logits, spawn

pytestmark = pytest.mark.distributed
CPU = torch.device("cpu")
MODELS = ("qwen3", "llama_kv1", "qwen3_moe_tp", "qwen3_moe_ep")


def build_llama_kv1(directory: Path) -> Path:
    """A tiny Llama with ONE KV head (replicated at tp 2), attention biases and tied embeddings, random
    non-trivial biases and norms, saved as safetensors."""
    from transformers import LlamaForCausalLM

    from layerzero.testing.hf_models import tiny_config

    cfg = tiny_config("llama")
    cfg.num_key_value_heads, cfg.attention_bias, cfg.tie_word_embeddings = 1, True, True
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def paths(checkpoints, tmp_path_factory) -> dict[str, tuple[str, bool]]:
    """model label -> (checkpoint directory, ep)."""
    kv1 = build_llama_kv1(tmp_path_factory.mktemp("llama_kv1"))
    return {
        "qwen3": (str(checkpoints["qwen3"]), False),
        "llama_kv1": (str(kv1), False),
        "qwen3_moe_tp": (str(checkpoints["qwen3_moe"]), False),
        "qwen3_moe_ep": (str(checkpoints["qwen3_moe"]), True),
    }


@pytest.fixture(scope="module")
def tp2(paths, tmp_path_factory) -> list[dict]:
    """One tp 2 spawn: the layer cases, then every model of :data:`MODELS` (rank order)."""
    return spawn("suite", 2, tmp_path_factory.mktemp("tp2"), True, [paths[m] for m in MODELS])


def _check_layers(errors: dict[str, float]) -> None:
    bad = {k: v for k, v in errors.items() if not v <= 1e-12}
    assert not bad, bad


def test_layers_tp2(tp2):
    for rank in tp2:
        _check_layers(rank["layers"])


def test_layers_tp3(tmp_path):
    for rank in spawn("suite", 3, tmp_path, True, []):
        _check_layers(rank["layers"])


@pytest.mark.parametrize("label", MODELS)
def test_model_tp2_matches_tp1(tp2, paths, label):
    i = MODELS.index(label)
    ref = model_logits(SINGLE, *paths[label])
    r0, r1 = tp2[0]["models"][i], tp2[1]["models"][i]
    for step, (a, b, want) in enumerate(zip(r0, r1, ref, strict=True)):
        assert a.shape == want.shape, (step, a.shape, want.shape)
        assert torch.equal(a, b), f"step {step}: the ranks' gathered logits differ"
        err = float((a - want).abs().max())
        assert err < 1e-4, f"{label} step {step}: max |tp2 - tp1| = {err:.2e}"


# ------------------------------------------------------------------------------ single process (no peers)
def test_comm_is_a_no_op_on_one_rank():
    x = torch.randn(3, 4)
    assert comm.all_reduce(x, SINGLE) is x and comm.all_gather(x, -1, SINGLE) is x


def test_tp1_model_has_no_parallel_layers(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints["qwen3"])
    model = build_model(cfg, 32, CPU, torch.float32)
    names = {type(m).__name__ for m in model.modules()}
    assert not any("Parallel" in n for n in names), names
    assert (model.num_local_heads, model.num_local_kv_heads) == (cfg.num_heads, cfg.num_kv_heads)


def test_ranks_load_only_their_shards(checkpoints):
    """tp 2 ranks' shards (read from the safetensors file as slices) put together equal the tp 1 weights."""
    path = checkpoints["qwen3"]
    cfg = ModelConfig.from_pretrained(path)
    full = build_model(cfg, 32, CPU, torch.float32)
    load_model_weights(full, path)
    ranks = []
    for r in range(2):
        m = build_model(cfg, 32, CPU, torch.float32, parallel=ParallelState(r, 2))
        load_model_weights(m, path)
        ranks.append(dict(m.named_parameters()))
    fp = dict(full.named_parameters())
    assert torch.equal(torch.cat([p["embed_tokens.weight"] for p in ranks]), fp["embed_tokens.weight"])
    assert torch.equal(torch.cat([p["lm_head.weight"] for p in ranks]), fp["lm_head.weight"])
    o = "layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([p[o] for p in ranks], dim=1), fp[o])
    q = "layers.0.self_attn.qkv_proj.weight"  # q rows of heads 0-3 then 4-7; k/v rows of head 0 then 1
    d, hq = cfg.head_dim, cfg.num_heads
    qs = torch.cat([p[q][: hq // 2 * d] for p in ranks])
    ks = torch.cat([p[q][hq // 2 * d : hq // 2 * d + d] for p in ranks])
    assert torch.equal(qs, fp[q][: hq * d]) and torch.equal(ks, fp[q][hq * d : hq * d + 2 * d])
    n = "layers.0.input_layernorm.weight"
    assert torch.equal(ranks[0][n], fp[n]) and torch.equal(ranks[1][n], fp[n])


def test_dummy_weights_differ_per_rank_where_sharded(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints["qwen3_moe"])
    ps = []
    for r in range(2):
        m = build_model(cfg, 32, CPU, torch.float32, parallel=ParallelState(r, 2))
        load_dummy_weights(m, seed=5)
        ps.append(dict(m.named_parameters()))
    assert not torch.equal(ps[0]["embed_tokens.weight"], ps[1]["embed_tokens.weight"])
    assert not torch.equal(ps[0]["layers.0.mlp.w13"], ps[1]["layers.0.mlp.w13"])
    assert torch.equal(ps[0]["layers.0.mlp.gate"], ps[1]["layers.0.mlp.gate"])  # the router: replicated
    assert torch.equal(ps[0]["norm.weight"], ps[1]["norm.weight"])


def test_sizes_that_do_not_split_are_refused(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints["qwen3"])  # 8 heads, 2 KV heads, intermediate 256
    with pytest.raises(lz.ConfigurationError, match=r"num_attention_heads 8 .*num_key_value_heads 2") as e:
        check_tensor_parallel(cfg, ParallelState(0, 3))
    assert isinstance(e.value, ValueError)
    with pytest.raises(lz.ConfigurationError, match="num_attention_heads 8 is not a multiple of 3"):
        build_model(cfg, 32, CPU, torch.float32, parallel=ParallelState(0, 3))
    moe = ModelConfig.from_pretrained(checkpoints["qwen3_moe"])  # 4 experts of intermediate 64
    with pytest.raises(lz.ConfigurationError, match=r"num_experts 4 < 8 ranks"):
        check_tensor_parallel(replace(moe, num_heads=8, num_kv_heads=8), ParallelState(0, 8, ep=True))
    check_tensor_parallel(moe, ParallelState(0, 4, ep=True))  # one expert per rank, KV heads replicated


def test_quantization_with_tp_is_refused(checkpoints):
    cfg = ModelConfig.from_pretrained(checkpoints["qwen3"])
    model = build_model(cfg, 32, CPU, torch.float32, parallel=ParallelState(1, 2))
    with pytest.raises(lz.ConfigurationError, match="tensor_parallel_size 2"):
        quantize_model(model, "int8")


def test_full_tensor_of_the_wrong_size_is_refused():
    layer = ColumnParallelLinear(4, 6, device=CPU, dtype=torch.float32, parallel=ParallelState(0, 2))
    with pytest.raises(lz.ConfigurationError, match="before the tensor-parallel split"):
        layer.load(torch.zeros(8, 4))


def test_sharded_load_refuses_integer_tensors(checkpoints, tmp_path):
    """The lazy (slice) path checks dtypes as the whole-tensor path does, naming the tensor and the file."""
    import shutil

    from safetensors.torch import save_file

    shutil.copy(checkpoints["qwen3"] / "config.json", tmp_path / "config.json")
    save_file(
        {"model.embed_tokens.weight": torch.zeros(512, 128, dtype=torch.int32)}, tmp_path / "m.safetensors"
    )
    cfg = ModelConfig.from_pretrained(tmp_path)
    model = build_model(cfg, 32, CPU, torch.float32, parallel=ParallelState(0, 2))
    with pytest.raises(
        lz.ConfigurationError, match=r"model.embed_tokens.weight of .*m.safetensors.*float dtype"
    ):
        load_model_weights(model, tmp_path)
