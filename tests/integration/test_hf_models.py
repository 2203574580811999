"""Real-model parity: stock transformers ("sdpa" and "eager") vs the same weights through LayerZero.

Each family (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE) is a tiny real model saved as safetensors and loaded
back. The LayerZero copy is loaded with ``attn_implementation="layerzero"`` and ``patch_model``-ed, and
``lz.trace()`` proves every attention, RMSNorm and RoPE call was served by LayerZero (exact call counts),
so a parity result cannot come from the stock code paths.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import layerzero as lz  # noqa: E402
from layerzero.core.errors import ConfigurationError, InvalidInputError  # noqa: E402
from layerzero.integrations.transformers import patch_model  # noqa: E402
from layerzero.testing import hf_models  # noqa: E402

pytestmark = pytest.mark.integration

REL_TOL = 1e-5
NEW_TOKENS = 32
REFERENCES = ("sdpa", "eager")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {f: hf_models.build_and_save(f, root / f, seed=0) for f in hf_models.MODEL_FAMILIES}


@pytest.fixture(scope="module")
def batch():
    return hf_models.padded_batch()


@pytest.fixture(scope="module")
def lz_models(checkpoints):
    """family -> model loaded with attn_implementation="layerzero" (each test patches it itself, after the
    stock reference ran: the RoPE swap is module-wide and would otherwise also serve the stock model)."""
    return {f: hf_models.load(f, p, attn_implementation="layerzero") for f, p in checkpoints.items()}


def op_calls(counts):
    totals = {"attention": 0, "rms_norm": 0, "rope": 0}
    for (op, _kernel), n in counts.items():
        if op in totals:
            totals[op] += n
    return totals


def expected_calls(model, handle, forwards):
    n_norms = sum(r.count for r in handle.patched if r.op.value == "rms_norm")
    layers = model.config.num_hidden_layers
    return {"attention": layers * forwards, "rms_norm": n_norms * forwards, "rope": layers * forwards}


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("family", hf_models.MODEL_FAMILIES)
def test_logits_parity(family, reference, checkpoints, lz_models, batch):
    stock, model = (
        hf_models.load(family, checkpoints[family], attn_implementation=reference),
        lz_models[family],
    )
    position_ids = hf_models.left_padded_position_ids(batch["attention_mask"])
    with torch.no_grad(), lz.trace() as stock_tr:
        want = stock(**batch, position_ids=position_ids).logits
    assert dict(stock_tr.counts) == {}  # the reference never touched LayerZero
    with torch.no_grad(), patch_model(model) as handle, lz.trace() as tr:
        got = model(**batch, position_ids=position_ids).logits
    assert op_calls(tr.counts) == expected_calls(model, handle, forwards=1)
    assert torch.isfinite(got[batch["attention_mask"].bool()]).all()
    err = hf_models.masked_rel_error(want, got, batch["attention_mask"])
    assert err <= REL_TOL, f"{family} vs {reference}: logits rel. error {err:.2e} > {REL_TOL:.0e}"


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("family", hf_models.MODEL_FAMILIES)
def test_greedy_generation_parity(family, reference, checkpoints, lz_models, batch):
    stock, model = (
        hf_models.load(family, checkpoints[family], attn_implementation=reference),
        lz_models[family],
    )
    gen = {"do_sample": False, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    with lz.trace() as stock_tr:
        want = stock.generate(**batch, **gen)
    assert dict(stock_tr.counts) == {}
    forwards = []
    hook = model.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with patch_model(model) as handle, lz.trace() as tr:
            got = model.generate(**batch, **gen)
    finally:
        hook.remove()
    assert got.shape == (2, batch["input_ids"].shape[1] + NEW_TOKENS)
    assert op_calls(tr.counts) == expected_calls(model, handle, forwards=len(forwards))
    assert len(forwards) == NEW_TOKENS  # prefill + 31 cached decode steps, all through LayerZero
    new_want, new_got = want[:, -NEW_TOKENS:], got[:, -NEW_TOKENS:]
    assert torch.equal(new_got, new_want), f"{family} vs {reference}: greedy tokens differ"
    assert new_want.unique().numel() > 8  # not a degenerate repeat of one token


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_is_exercised(family, checkpoints, batch):
    """The window must change the logits for these prompts; otherwise parity would not test it."""
    windowed = hf_models.load(family, checkpoints[family], attn_implementation="sdpa")
    config = hf_models.tiny_config(family)
    config.sliding_window = None
    if hasattr(config, "layer_types"):
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    config.use_sliding_window = False
    full = type(windowed)(config).eval()
    full.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        a, b = windowed(**batch).logits, full(**batch).logits
    assert hf_models.masked_rel_error(a, b, batch["attention_mask"]) > 1e-3
    assert batch["attention_mask"].sum(-1).max() > hf_models.SLIDING_WINDOW


def test_tiny_configs_keep_gqa_and_family_features():
    for family in hf_models.MODEL_FAMILIES:
        cfg = hf_models.tiny_config(family)
        assert cfg.model_type == family
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 2)
        assert cfg.num_hidden_layers <= 4 and cfg.hidden_size <= 512
    assert hf_models.tiny_config("mistral").sliding_window == hf_models.SLIDING_WINDOW
    assert hf_models.tiny_config("qwen2").layer_types == ["full_attention", "sliding_attention"]
    moe = hf_models.tiny_config("qwen3_moe")
    assert (moe.num_experts, moe.num_experts_per_tok) == (4, 2)
    with pytest.raises(ConfigurationError, match="Did you mean 'llama'"):
        hf_models.tiny_config("lama")


def test_build_is_seeded_and_roundtrips(checkpoints, tmp_path):
    again = hf_models.build_and_save("llama", tmp_path / "again", seed=0)
    other = hf_models.build_and_save("llama", tmp_path / "other", seed=1)
    a, b, c = (hf_models.load("llama", p) for p in (checkpoints["llama"], again, other))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    assert (checkpoints["llama"] / "model.safetensors").is_file()
    norm = sa["model.norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))  # RMSNorm weight matters
    with pytest.raises(ConfigurationError, match="model_type"):
        hf_models.load("mistral", checkpoints["llama"])


def test_padded_batch_is_left_padded_and_deterministic():
    batch = hf_models.padded_batch((4, 2), seed=5)
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))
    assert torch.equal(batch["input_ids"][1, :2], torch.zeros(2, dtype=torch.int64))
    assert int(batch["input_ids"][batch["attention_mask"].bool()].min()) >= 3
    assert torch.equal(batch["input_ids"], hf_models.padded_batch((4, 2), seed=5)["input_ids"])
    assert not torch.equal(batch["input_ids"], hf_models.padded_batch((4, 2), seed=6)["input_ids"])
    with pytest.raises(InvalidInputError, match="lengths"):
        hf_models.padded_batch((3, 0))


def test_position_ids_and_rel_error_hand_worked():
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert torch.equal(hf_models.left_padded_position_ids(mask), torch.tensor([[0, 1, 2], [1, 0, 1]]))
    ref = torch.tensor([[[1.0], [2.0], [-4.0]], [[100.0], [1.0], [2.0]]])
    cand = ref.clone()
    cand[0, 1, 0] = 2.5  # counted: |diff| 0.5
    cand[1, 0, 0] = 0.0  # padded position: ignored (and its 100 is not the max)
    assert hf_models.masked_rel_error(ref, cand, mask) == pytest.approx(0.5 / 4.0)
    with pytest.raises(InvalidInputError, match="all padding"):
        hf_models.masked_rel_error(ref, cand, torch.zeros_like(mask))


def test_demo_main_reports_parity(capsys):
    from layerzero import demo

    assert demo.main(["--family", "llama", "--new-tokens", "4", "--plain"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["family", "attention", "rms_norm", "rope"]
    row = next(line for line in out.splitlines() if line.startswith("llama"))
    assert " - " not in row and "yes" in row  # every op served by a kernel, tokens equal
    assert "parity: OK" in out


def test_demo_flags_a_failed_family():
    from layerzero import demo

    bad = demo.FamilyResult(
        "llama", {"attention": "k x1", "rms_norm": "-", "rope": "k x1"}, 0.0, True, 1.0, 1.0, 1e-5
    )
    assert not bad.ok  # rms_norm never went through LayerZero
    assert not demo.FamilyResult("llama", dict.fromkeys(demo.OPS, "k x1"), 2e-5, True, 1.0, 1.0, 1e-5).ok
    assert demo.FamilyResult("llama", dict.fromkeys(demo.OPS, "k x1"), 1e-6, True, 1.0, 1.0, 1e-5).ok
    assert "NO" in demo.render(
        [demo.FamilyResult("qwen2", dict.fromkeys(demo.OPS, "k x1"), 0.0, False, 1, 1, 1e-5)], use_rich=False
    )
