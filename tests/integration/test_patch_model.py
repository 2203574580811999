"""patch_model / PatchHandle: what is patched, exact undo, refcounted RoPE, refusals, strict mode."""

from __future__ import annotations

import logging
import types

import pytest
import torch

pytest.importorskip("transformers")

import layerzero as lz  # noqa: E402
from layerzero.core.errors import ConfigurationError, InvalidInputError  # noqa: E402
from layerzero.integrations.transformers import (  # noqa: E402
    SUPPORTED_MODEL_TYPES,
    PatchOp,
    lz_apply_rotary_pos_emb,
    patch_model,
    rope_refcount,
)
from layerzero.testing import hf_models  # noqa: E402

pytestmark = pytest.mark.integration

LLAMA_MOD = "transformers.models.llama.modeling_llama"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_patch")
    return {f: hf_models.build_and_save(f, root / f, seed=0) for f in ("llama", "qwen3")}


@pytest.fixture
def llama(checkpoints):
    return hf_models.load("llama", checkpoints["llama"], attn_implementation="sdpa")


@pytest.fixture
def modeling_llama():
    from transformers.models.llama import modeling_llama

    return modeling_llama


def norms(model, cls_name="LlamaRMSNorm"):
    return [m for m in model.modules() if type(m).__name__ == cls_name]


def logits(model):
    batch = hf_models.padded_batch()
    with torch.no_grad():
        return model(**batch, position_ids=hf_models.left_padded_position_ids(batch["attention_mask"])).logits


def test_supported_model_types():
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


def test_patch_and_undo_restore_exact_originals(llama, modeling_llama):
    original_rope = modeling_llama.apply_rotary_pos_emb
    before = logits(llama)
    modules = norms(llama)
    assert len(modules) == 2 * llama.config.num_hidden_layers + 1
    assert not any("forward" in m.__dict__ for m in modules)

    handle = patch_model(llama)
    assert {r.op for r in handle.patched} == set(PatchOp)
    assert [r.count for r in handle.patched if r.op is PatchOp.RMS_NORM] == [len(modules)]
    assert handle.skipped == ()
    assert all(m.__dict__["forward"].__self__ is m for m in modules)
    assert modeling_llama.apply_rotary_pos_emb is lz_apply_rotary_pos_emb
    assert llama.config._attn_implementation == "layerzero"
    with lz.trace() as tr:
        during = logits(llama)
    assert {op for op, _ in tr.counts} == {"attention", "rms_norm", "rope"}
    assert hf_models.masked_rel_error(before, during, hf_models.padded_batch()["attention_mask"]) <= 1e-5

    handle.undo()
    assert not handle.active
    assert not any("forward" in m.__dict__ for m in modules)
    assert all(m.forward.__func__ is type(m).forward for m in modules)
    assert modeling_llama.apply_rotary_pos_emb is original_rope
    assert llama.config._attn_implementation == "sdpa"
    with lz.trace() as tr:
        after = logits(llama)
    assert dict(tr.counts) == {}
    assert torch.equal(after, before)

    handle.undo()  # double undo: a no-op
    assert modeling_llama.apply_rotary_pos_emb is original_rope
    assert not any("forward" in m.__dict__ for m in modules)


def test_preexisting_instance_forward_is_restored(llama):
    module = norms(llama)[0]
    custom = types.MethodType(type(module).forward, module)
    module.forward = custom
    with patch_model(llama, ops=("rms_norm",)) as handle:
        assert module.__dict__["forward"] is not custom
        assert handle.active
    assert module.__dict__["forward"] is custom


def test_context_manager_undoes_on_error(llama, modeling_llama):
    original_rope = modeling_llama.apply_rotary_pos_emb
    with pytest.raises(RuntimeError, match="boom"), patch_model(llama):
        raise RuntimeError("boom")
    assert modeling_llama.apply_rotary_pos_emb is original_rope
    assert llama.config._attn_implementation == "sdpa"


def test_double_patch_is_refused_until_undo(llama):
    handle = patch_model(llama)
    with pytest.raises(ConfigurationError, match="already patched|unpatched model"):
        patch_model(llama)
    handle.undo()
    second = patch_model(llama)
    assert second.active
    second.undo()


def test_rope_swap_is_refcounted_across_models(checkpoints, modeling_llama):
    original_rope = modeling_llama.apply_rotary_pos_emb
    a = hf_models.load("llama", checkpoints["llama"])
    b = hf_models.load("llama", checkpoints["llama"])
    ha, hb = patch_model(a), patch_model(b)
    assert rope_refcount(LLAMA_MOD) == 2
    ha.undo()
    assert rope_refcount(LLAMA_MOD) == 1
    assert modeling_llama.apply_rotary_pos_emb is lz_apply_rotary_pos_emb  # b still needs it
    assert a.config._attn_implementation == "sdpa" and b.config._attn_implementation == "layerzero"
    hb.undo()
    assert rope_refcount(LLAMA_MOD) == 0
    assert modeling_llama.apply_rotary_pos_emb is original_rope


def test_ops_subset_leaves_the_rest_alone(llama, modeling_llama):
    original_rope = modeling_llama.apply_rotary_pos_emb
    with patch_model(llama, ops=["rms_norm"]) as handle:
        assert [r.op for r in handle.patched] == [PatchOp.RMS_NORM]
        assert modeling_llama.apply_rotary_pos_emb is original_rope
        assert llama.config._attn_implementation == "sdpa"
        with lz.trace() as tr:
            logits(llama)
        assert {op for op, _ in tr.counts} == {"rms_norm"}


def test_qwen3_q_and_k_norms_are_patched(checkpoints):
    model = hf_models.load("qwen3", checkpoints["qwen3"])
    layers = model.config.num_hidden_layers
    with patch_model(model) as handle:
        record = next(r for r in handle.patched if r.op is PatchOp.RMS_NORM)
        assert record.count == 4 * layers + 1  # input, post-attention, q_norm, k_norm per layer + final
        attn = model.model.layers[0].self_attn
        assert "forward" in attn.q_norm.__dict__ and "forward" in attn.k_norm.__dict__


class _FakeConfig:
    def __init__(self, model_type):
        self.model_type = model_type


@pytest.mark.parametrize(
    "model_type, match", [("gpt_neox", r"one of \['llama'"), ("lama", "Did you mean 'llama'")]
)
def test_unknown_model_type_is_refused(model_type, match):
    model = torch.nn.Linear(2, 2)
    model.config = _FakeConfig(model_type)
    with pytest.raises(ConfigurationError, match=match):
        patch_model(model)


def test_bad_model_and_ops_are_refused(llama):
    with pytest.raises(InvalidInputError, match="torch.nn.Module|PreTrainedModel"):
        patch_model("llama")
    with pytest.raises(ConfigurationError, match="model_type"):
        patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigurationError, match="Did you mean 'rope'"):
        patch_model(llama, ops=("ropes",))
    with pytest.raises(ConfigurationError, match="non-empty"):
        patch_model(llama, ops=())


def test_strict_validation_refuses_before_changing_anything(llama, modeling_llama, caplog):
    original_rope = modeling_llama.apply_rotary_pos_emb
    broken = norms(llama)[1]
    broken.weight = torch.nn.Parameter(torch.ones(2, 64))
    with pytest.raises(ConfigurationError, match="1-D `weight`"):
        patch_model(llama)
    assert not any("forward" in m.__dict__ for m in norms(llama))
    assert modeling_llama.apply_rotary_pos_emb is original_rope
    assert llama.config._attn_implementation == "sdpa"

    with caplog.at_level(logging.WARNING, logger="layerzero.integrations.transformers"):
        handle = patch_model(llama, strict=False)
    try:
        assert len(handle.skipped) == 1 and "1-D `weight`" in handle.skipped[0]
        assert "1-D `weight`" in caplog.text
        assert "forward" not in broken.__dict__
        assert sum("forward" in m.__dict__ for m in norms(llama)) == len(norms(llama)) - 1
    finally:
        handle.undo()


def test_rope_signature_mismatch_is_detected(llama, modeling_llama, monkeypatch):
    def other_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return q, k

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", other_rope)
    with pytest.raises(ConfigurationError, match="signature"):
        patch_model(llama)
    with patch_model(llama, strict=False) as handle:
        assert PatchOp.ROPE not in {r.op for r in handle.patched}
        assert modeling_llama.apply_rotary_pos_emb is other_rope
    assert modeling_llama.apply_rotary_pos_emb is other_rope


def test_unswitchable_attention_rolls_everything_back(llama, modeling_llama, monkeypatch):
    original_rope = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(llama, "set_attn_implementation", lambda impl: None)
    with pytest.raises(ConfigurationError, match="cannot switch attention"):
        patch_model(llama)
    assert modeling_llama.apply_rotary_pos_emb is original_rope
    assert rope_refcount(LLAMA_MOD) == 0
    assert not any("forward" in m.__dict__ for m in norms(llama))


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rope_replacement_matches_transformers(modeling_llama, unsqueeze_dim, cos_batch):
    gen = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 5, 8, 2, 16
    q, k = torch.randn(b, hq, s, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen)
    angles = torch.rand(cos_batch, s, d // 2, generator=gen) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    got = lz_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    with pytest.raises(InvalidInputError, match="unsqueeze_dim"):
        lz_apply_rotary_pos_emb(q, k, cos, sin, 3)


def test_patched_rms_norm_matches_original(llama):
    module = norms(llama)[0]
    x = torch.randn(2, 3, llama.config.hidden_size, generator=torch.Generator().manual_seed(1))
    want = module(x)
    with patch_model(llama, ops=("rms_norm",)), lz.trace() as tr:
        got = module(x)
    assert sum(tr.counts.values()) == 1
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
