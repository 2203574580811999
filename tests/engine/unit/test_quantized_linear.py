"""Weight-only quantized linears (``LLM(quantization=...)``): the layer against an independent float64 oracle,
the error bound each format implies for ``x @ W.T``, memory, int4's group-size rule and the option's
errors."""

from __future__ import annotations

import logging

import pytest
import torch

import layerzero as lz
from layerzero.engine import LLM, EngineConfig
from layerzero.engine.config import QUANTIZATIONS
from layerzero.engine.layers.linear import Linear
from layerzero.engine.layers.quantized_linear import (
    QUANTIZATION_FORMATS,
    QuantizedLinear,
    int4_group_size,
    module_bytes,
    quantize_model,
)

FORMATS = ("int8", "int4", "fp8")


def _linear(n: int, k: int, seed: int = 0, bias: bool = False) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


def _dequant64(q: QuantizedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_hat, per-element scale) in float64, from the buffers alone (not lz.dequantize)."""
    n, k = q.out_features, q.in_features
    if q.quantization == "int4":
        lo, hi = (q.qdata & 15).double(), (q.qdata >> 4).double()
        codes = torch.stack((lo, hi), dim=-1).reshape(n, k)
        g = q.group_size
        s = q.qscale.double().repeat_interleave(g, dim=1)
        z = q.qzero.double().repeat_interleave(g, dim=1)
        return (codes - z) * s, s
    s = q.qscale.double().expand(n, k)
    return q.qdata.double() * s, s


def _bound(q: QuantizedLinear, w: torch.Tensor) -> torch.Tensor:
    """docs/quantization.md's per-element bound on |w - w_hat| (float64)."""
    _, s = _dequant64(q)
    if q.quantization == "fp8":
        return torch.maximum(2.0**-4 * w.double().abs(), 2.0**-10 * s)
    return s / 2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("t", "n", "k", "bias"), [(5, 96, 256, False), (1, 64, 128, True), (7, 40, 96, True)]
)
def test_quantized_linear_matches_float64_oracle(fmt: str, t: int, n: int, k: int, bias: bool) -> None:
    lin = _linear(n, k, seed=n + k, bias=bias)
    w = lin.weight.detach().clone()
    q = QuantizedLinear(lin, fmt)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(1))
    y = q(x)
    assert y.dtype == torch.float32 and y.shape == (t, n)
    w_hat, _ = _dequant64(q)
    b = lin.bias.double() if bias else torch.zeros(n, dtype=torch.float64)
    want = x.double() @ w_hat.T + b
    tol = 1e-5 * (x.double().abs() @ w_hat.abs().T + b.abs()) + 1e-6  # float32 accumulation over k
    assert bool(((y.double() - want).abs() <= tol).all()), float((y.double() - want).abs().max())
    # the output's drift against the float layer is within what the format's per-weight bound implies
    exact = x.double() @ w.double().T + b
    implied = x.double().abs() @ _bound(q, w).T + tol
    assert bool(((y.double() - exact).abs() <= implied).all())
    assert bool(((w_hat - w.double()).abs() <= _bound(q, w) + 2.0**-21 * w.double().abs()).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_drop_by_the_formats_factor(fmt: str) -> None:
    n, k = 192, 256
    model = torch.nn.Module()
    model.proj = _linear(n, k)
    model.lm_head = _linear(64, k, seed=1)
    head = module_bytes(model.lm_head)
    before = module_bytes(model)
    summary = quantize_model(model, fmt)
    assert summary.layers == 1 and summary.float_bytes == 4 * n * k
    expected = n * k // 2 + 5 * n * (k // 128) if fmt == "int4" else n * k + 4 * n  # codes + scales (+ zeros)
    assert summary.quantized_bytes == expected
    assert module_bytes(model) == before - 4 * n * k + expected
    assert (
        isinstance(model.lm_head, Linear) and module_bytes(model.lm_head) == head
    )  # the LM head stays float
    assert summary.float_bytes / summary.quantized_bytes > (7.4 if fmt == "int4" else 3.9)


def test_int4_group_size_rule(caplog: pytest.LogCaptureFixture) -> None:
    assert int4_group_size(256) == 128 and int4_group_size(128) == 128
    with caplog.at_level(logging.WARNING, logger="layerzero.engine"):
        assert int4_group_size(96, "layers.0.mlp.down_proj") == 32
    assert "down_proj" in caplog.text and "groups of 32" in caplog.text
    with pytest.raises(lz.ConfigurationError, match="in_features divisible by a power of two"):
        int4_group_size(40)  # 8 would be the largest power of two: below the 16 floor
    old = lz.get_config().strict
    lz.configure(strict=True)
    try:
        with pytest.raises(lz.ConfigurationError, match="Strict mode refuses"):
            int4_group_size(96)
    finally:
        lz.configure(strict=old)


@pytest.mark.parametrize("bad", ["int3", "INT8", "fp8_e4m3", 8, ""])
def test_bad_quantization_is_refused_before_loading(bad: object) -> None:
    with pytest.raises(
        lz.ConfigurationError,
        match=r"LLM quantization: expected one of \('int8', 'int4', 'fp8', 'fp8_w8a8'\)",
    ):
        LLM("/nonexistent/checkpoint", quantization=bad)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig("m", quantization=bad)
    with pytest.raises(lz.ConfigurationError, match="LLM quantization"):
        quantize_model(torch.nn.Module(), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("t", "n", "k", "bias"), [(5, 96, 256, False), (1, 64, 128, True), (3, 40, 96, True)]
)
def test_w8a8_layer_matches_its_float64_oracle(t: int, n: int, k: int, bias: bool) -> None:
    """``quantization="fp8_w8a8"``: the same fp8 buffers as ``"fp8"``, and the forward quantizes each row of x
    to e4m3 (scale amax / 448, float32) before the product: float64 oracle from the buffers and that rule."""
    lin = _linear(n, k, seed=t + n, bias=bias)
    q, ref = QuantizedLinear(lin, "fp8_w8a8"), QuantizedLinear(lin, "fp8")
    assert torch.equal(q.qdata.view(torch.uint8), ref.qdata.view(torch.uint8)) and torch.equal(
        q.qscale, ref.qscale
    )
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(k))
    s = (x.abs().amax(dim=1, keepdim=True) / 448).clamp_min(2.0**-126)
    xq = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s.double()
    want = xq @ _dequant64(q)[0].t() + (lin.bias.double() if bias else 0)
    with torch.no_grad():
        got = q(x)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    with torch.no_grad():  # not the weight-only result: the activation's rounding is in it
        assert not torch.allclose(got, ref(x), rtol=1e-4, atol=0)


def test_option_names_agree() -> None:
    assert set(QUANTIZATIONS) == set(QUANTIZATION_FORMATS)
    assert EngineConfig("m").quantization is None
