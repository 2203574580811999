"""The ``attn_implementation="layerzero"`` function and its registration, against a float64 oracle."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import layerzero as lz  # noqa: E402
from layerzero.core.errors import ConfigurationError, InvalidInputError  # noqa: E402
from layerzero.integrations.transformers import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    check_transformers_version,
    from_pretrained,
    is_registered,
    layerzero_attention_forward,
    register,
)
from layerzero.testing import hf_models  # noqa: E402

pytestmark = pytest.mark.integration

SRC = Path(__file__).resolve().parents[2] / "src"
B, HQ, HKV, D = 2, 8, 2, 16


def oracle(q, k, v, *, mask=None, causal=False, scale=None):
    """float64 softmax(QK^T * scale + mask) V with K/V heads repeated; fully masked rows give 0. -> [B, S, H,
    D]."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        allowed &= mask
    elif mask is not None:
        scores = scores + mask.double()
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


def qkv(sq, sk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, sq, D, generator=gen)
    k = torch.randn(B, HKV, sk, D, generator=gen)
    v = torch.randn(B, HKV, sk, D, generator=gen)
    return q, k, v


def module(is_causal=True):
    return types.SimpleNamespace(is_causal=is_causal, num_key_value_groups=HQ // HKV, training=False)


def padded_causal_mask(lengths, width):
    """Hand-built [B, 1, S, S] bool mask (True = attend): causal AND left padding."""
    pad = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, n in enumerate(lengths):
        pad[row, width - n :] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (causal[None] & pad[:, None, :])[:, None]


@pytest.fixture(autouse=True)
def _registered():
    register()


def test_register_is_idempotent_and_wires_attention_and_mask():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register()
    register()
    assert is_registered()
    assert AttentionInterface._global_mapping[ATTN_IMPLEMENTATION] is layerzero_attention_forward
    # without a mask function transformers would build no mask at all for "layerzero" (transformers' "sdpa"
    # one, wrapped to skip a plain causal mask under CUDA-graph capture: test_hf_capture_mask)
    mask_fn = AttentionMaskInterface._global_mapping[ATTN_IMPLEMENTATION]
    assert mask_fn.__wrapped__ is AttentionMaskInterface._global_mapping["sdpa"]


def test_import_layerzero_does_not_import_transformers():
    code = (
        "import sys, layerzero, layerzero.integrations.transformers, layerzero.testing.hf_models; "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "version, ok",
    [
        ("5.23.0", True),
        ("4.56.0", True),
        ("4.56.0.dev0", True),
        ("4.55.4", False),
        ("3.0", False),
        ("nightly", False),
    ],
)
def test_check_transformers_version(version, ok):
    if ok:
        assert check_transformers_version(version)[:2] >= (4, 56)
    else:
        with pytest.raises(ConfigurationError, match="transformers version"):
            check_transformers_version(version)


def test_register_refuses_old_transformers(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.40.1")
    with pytest.raises(ConfigurationError, match=r"expected >= 4\.56, got 4\.40\.1"):
        register()


@pytest.mark.parametrize(
    "case",
    [
        "causal",
        "bidirectional",
        "padded_bool",
        "float_additive",
        "decode",
        "sliding_window",
        "static_prefill",
        "scale",
    ],
)
def test_forward_matches_float64_oracle(case):
    sq = sk = 7
    mask, causal_expected, kwargs, mod = None, False, {}, module()
    if case == "causal":
        causal_expected = True
    elif case == "bidirectional":
        mod = module(is_causal=False)
    elif case == "padded_bool":
        mask = padded_causal_mask((7, 4), 7)
    elif case == "float_additive":
        gen = torch.Generator().manual_seed(3)
        mask = torch.randn(B, 1, sq, sk, generator=gen)
        mask[:, :, :, 0] = float("-inf")  # a masked key column, never a whole row
    elif case == "decode":
        sq, sk = 1, 9  # one query over the whole cache: no causal masking
    elif case == "sliding_window":
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
        mask = ((j <= i) & (i - j < 3)).expand(B, 1, sq, sk)
        kwargs["sliding_window"] = 3
    elif case == "static_prefill":
        sk, causal_expected = 12, True  # empty static cache: keys past Sq are masked top-left
    elif case == "scale":
        causal_expected, kwargs["scaling"] = True, 0.37
    q, k, v = qkv(sq, sk)
    with lz.trace() as tr:
        out, weights = layerzero_attention_forward(mod, q, k, v, mask, **kwargs)
    want = oracle(q, k, v, mask=mask, causal=causal_expected, scale=kwargs.get("scaling"))
    assert weights is None
    assert out.shape == (B, sq, HQ, D) and out.is_contiguous() and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    assert sum(n for (op, _), n in tr.counts.items() if op == "attention") == 1


def test_fully_masked_padding_rows_are_zero():
    q, k, v = qkv(7, 7)
    out, _ = layerzero_attention_forward(module(), q, k, v, padded_causal_mask((7, 4), 7))
    assert torch.count_nonzero(out[1, :3]) == 0  # three left-pad query rows see no key
    assert torch.count_nonzero(out[1, 3:]) > 0


def test_position_bias_is_folded_into_the_mask():
    q, k, v = qkv(5, 5)
    bias = torch.randn(1, HQ, 5, 5, generator=torch.Generator().manual_seed(7))
    out, _ = layerzero_attention_forward(module(is_causal=True), q, k, v, None, position_bias=bias)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    want = oracle(q, k, v, mask=bias.masked_fill(~causal, float("-inf")))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"softcap": -30.0}, "softcap"),
        ({"output_attentions": True}, "output_attentions"),
        ({"head_mask": torch.ones(HQ)}, "head_mask"),
        ({"cache": object()}, "paged cache"),
        ({"sliding_window": 4, "is_causal": False}, "sliding window without a mask"),
    ],
)
def test_unsupported_features_raise_typed_errors(kwargs, match):
    q, k, v = qkv(7, 7)
    with pytest.raises(InvalidInputError, match=match):
        layerzero_attention_forward(module(), q, k, v, None, **kwargs)


def test_sliding_window_shorter_than_window_needs_no_mask():
    q, k, v = qkv(5, 5)
    out, _ = layerzero_attention_forward(module(), q, k, v, None, sliding_window=8)
    torch.testing.assert_close(out.double(), oracle(q, k, v, causal=True), atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return hf_models.build_and_save("llama", tmp_path_factory.mktemp("llama"), seed=0)


def test_from_pretrained_registers_and_routes_attention(llama_dir):
    from transformers import AutoModelForCausalLM

    model = from_pretrained(AutoModelForCausalLM, llama_dir, dtype=torch.float32).eval()
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    batch = hf_models.padded_batch()
    with torch.no_grad(), lz.trace() as tr:
        model(**batch)
    calls = sum(n for (op, _), n in tr.counts.items() if op == "attention")
    assert calls == model.config.num_hidden_layers


def test_from_pretrained_refuses_other_implementations(llama_dir):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ConfigurationError, match="attn_implementation: expected 'layerzero', got 'sdpa'"):
        from_pretrained(AutoModelForCausalLM, llama_dir, attn_implementation="sdpa")
    with pytest.raises(ConfigurationError, match="from_pretrained"):
        from_pretrained(object(), llama_dir)


def test_output_attentions_through_a_model_is_refused(llama_dir):
    model = hf_models.load("llama", llama_dir, attn_implementation=ATTN_IMPLEMENTATION)
    with torch.no_grad(), pytest.raises(InvalidInputError, match="output_attentions"):
        model(**hf_models.padded_batch(), output_attentions=True)
