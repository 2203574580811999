"""diffusers integration: LayerZeroAttnProcessor matches AttnProcessor2_0 on a tiny UNet and a tiny DiT
(float64)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip(
    "diffusers", reason="diffusers not installed (pip install 'layerzero[diffusers]')"
)

import layerzero as lz  # noqa: E402
from layerzero.integrations.diffusers import (  # noqa: E402
    LayerZeroAttnProcessor,
    attention_modules,
    patch_diffusers,
)

ATOL = RTOL = 1e-5  # float64 models: the two processors agree to rounding; fp32 bound kept as the contract


def _processors(model: torch.nn.Module) -> set[str]:
    return {type(m.processor).__name__ for _, m in attention_modules(model)}


@pytest.fixture(scope="module")
def unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return (
        diffusers.UNet2DConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            cross_attention_dim=32,
            sample_size=16,
            attention_head_dim=8,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )
        .double()
        .eval()
    )


@pytest.fixture(scope="module")
def dit() -> torch.nn.Module:
    torch.manual_seed(0)
    return (
        diffusers.DiTTransformer2DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=8,
            num_layers=2,
            sample_size=8,
            patch_size=2,
            num_embeds_ada_norm=10,
        )
        .double()
        .eval()
    )


@pytest.fixture(scope="module")
def pixart() -> torch.nn.Module:
    torch.manual_seed(0)
    return (
        diffusers.PixArtTransformer2DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=8,
            num_layers=2,
            sample_size=8,
            patch_size=2,
            cross_attention_dim=16,
            caption_channels=12,
        )
        .double()
        .eval()
    )


def _unet_run(unet: torch.nn.Module, mask: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, 16, generator=g, dtype=torch.float64)
    ehs = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    kw = {}
    if mask:
        m = torch.ones(2, 7, dtype=torch.bool)
        m[1, -3:] = False
        kw["encoder_attention_mask"] = m
    with torch.no_grad():
        return unet(x, 3, encoder_hidden_states=ehs, **kw).sample


def _dit_run(dit: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        return dit(x, timestep=torch.tensor([1, 5]), class_labels=torch.tensor([0, 3])).sample


def _pixart_run(model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    ehs = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 5)
    mask[0, -2:] = 0
    with torch.no_grad():
        return model(
            x,
            encoder_hidden_states=ehs,
            timestep=torch.tensor([1, 5]),
            encoder_attention_mask=mask,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        ).sample


@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "cross_mask"])
def test_unet_parity_trace_and_undo(unet: torch.nn.Module, mask: bool) -> None:
    assert _processors(unet) == {"AttnProcessor2_0"}
    n_layers = len(attention_modules(unet))
    assert n_layers == 8  # down: 1 block x (self+cross); mid: 2; up: 2 blocks x 2
    ref = _unet_run(unet, mask)
    handle = lz.patch_model(unet)
    try:
        assert handle.count == n_layers and _processors(unet) == {"LayerZeroAttnProcessor"}
        with lz.trace() as t:
            out = _unet_run(unet, mask)
        assert (
            sum(c for (op, _), c in t.counts.items() if op == "attention") == n_layers
        )  # one call per layer
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    finally:
        handle.undo()
    assert _processors(unet) == {"AttnProcessor2_0"} and not handle.active
    with lz.trace() as t:
        again = _unet_run(unet, mask)
    assert not t.counts
    torch.testing.assert_close(again, ref, rtol=0, atol=0)


def test_dit_parity_trace_and_undo(dit: torch.nn.Module) -> None:
    assert _processors(dit) == {"AttnProcessor2_0"}
    ref = _dit_run(dit)
    with lz.patch_diffusers(dit) as handle:
        assert handle.count == 2  # 2 blocks x self-attention
        with lz.trace() as t:
            out = _dit_run(dit)
        assert t.counts and sum(t.counts.values()) == 2 and t.kernels_for("attention")
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    assert _processors(dit) == {"AttnProcessor2_0"}
    torch.testing.assert_close(_dit_run(dit), ref, rtol=0, atol=0)


def test_pixart_parity_with_cross_attention_mask(pixart: torch.nn.Module) -> None:
    ref = _pixart_run(pixart)
    with patch_diffusers(pixart) as handle:
        assert handle.count == 4  # 2 blocks x (self + cross)
        with lz.trace() as t:
            out = _pixart_run(pixart)
        assert sum(t.counts.values()) == 4
        torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(_pixart_run(pixart), ref, rtol=0, atol=0)


def test_float32_unet_parity(unet: torch.nn.Module) -> None:
    model = diffusers.UNet2DConditionModel.from_config(unet.config).eval()
    model.load_state_dict({k: v.float() for k, v in unet.state_dict().items()})
    g = torch.Generator().manual_seed(4)
    x, ehs = torch.randn(1, 4, 16, 16, generator=g), torch.randn(1, 5, 32, generator=g)
    with torch.no_grad():
        ref = model(x, 7, encoder_hidden_states=ehs).sample
        with patch_diffusers(model):
            out = model(x, 7, encoder_hidden_states=ehs).sample
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_double_patch_and_non_diffusers_and_unsupported_processor_raise(dit: torch.nn.Module) -> None:
    with patch_diffusers(dit):
        with pytest.raises(lz.ConfigurationError, match="already patched"):
            patch_diffusers(dit)
    with pytest.raises(lz.ConfigurationError, match="no.*diffusers Attention|holding diffusers Attention"):
        patch_diffusers(torch.nn.Linear(2, 2))
    from diffusers.models.attention_processor import AttnAddedKVProcessor

    block = diffusers.models.attention_processor.Attention(
        query_dim=16, heads=2, dim_head=8, processor=AttnAddedKVProcessor()
    )
    with pytest.raises(lz.ConfigurationError, match="AttnAddedKVProcessor"):
        patch_diffusers(block)
    assert type(block.processor).__name__ == "AttnAddedKVProcessor"  # nothing replaced


def test_processor_direct_on_attention_block_4d_residual_rescale() -> None:
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    torch.manual_seed(5)
    attn = (
        Attention(
            query_dim=32,
            heads=4,
            dim_head=8,
            norm_num_groups=8,
            residual_connection=True,
            rescale_output_factor=2.0,
            bias=True,
            qk_norm="layer_norm",
        )
        .double()
        .eval()
    )
    x = torch.randn(2, 32, 3, 5, dtype=torch.float64)  # [B, C, H, W] feature map, odd sizes
    mask = torch.zeros(2, 15, dtype=torch.float64)
    mask[0, 10:] = -1e4
    with torch.no_grad():
        ref = AttnProcessor2_0()(attn, x, attention_mask=mask)
        with lz.trace() as t:
            out = LayerZeroAttnProcessor()(attn, x, attention_mask=mask)
    assert sum(t.counts.values()) == 1
    assert out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_import_layerzero_does_not_import_diffusers() -> None:
    code = (
        "import sys, layerzero, layerzero.integrations.diffusers; "
        "assert 'diffusers' not in sys.modules, 'diffusers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
