"""``LayerZeroAttnProcessor``: a diffusers attention processor whose attention core is
:func:`layerzero.attention`.

It follows diffusers' ``AttnProcessor2_0`` step for step (spatial norm, 4-D -> token reshape, mask
preparation, group norm, Q/K/V projections, cross-attention with ``norm_cross``, ``norm_q``/``norm_k``, output
projection and dropout, residual connection, ``rescale_output_factor``) and replaces only
``F.scaled_dot_product_attention`` with ``lz.attention(q, k, v, attn_mask=mask, layout="BHSD")``. Like the
stock processor it leaves ``scale`` to the default ``1/sqrt(head_dim)`` (diffusers' ``Attention.scale`` is the
same value unless ``scale_qk=False``) and uses no attention dropout.

This module imports neither diffusers nor anything else outside torch and LayerZero: the processor only calls
methods of the ``Attention`` module it is given.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from layerzero import ops as lz_ops


class LayerZeroAttnProcessor:
    """diffusers attention processor (the ``AttnProcessor2_0`` contract) that calls
    :func:`layerzero.attention`.

    Used by ``Attention`` blocks of ``UNet2DConditionModel`` (self- and cross-attention, the mid block),
    ``DiTTransformer2DModel`` and ``PixArtTransformer2DModel`` (``BasicTransformerBlock``), and any other
    model whose ``Attention`` modules run ``AttnProcessor2_0``. Joint-attention models (SD3/Flux:
    ``JointAttnProcessor2_0``, ``FluxAttnProcessor``) have another contract and are not covered.

    Shapes: ``hidden_states`` is ``[B, S, C]`` or ``[B, C, H, W]`` (image feature map; ``S = H*W``);
    ``encoder_hidden_states`` (cross-attention) ``[B, S_kv, C_cross]``; ``attention_mask`` ``[B, S_kv]``,
    ``[B, 1, S_kv]`` or ``[B, S_q, S_kv]`` (boolean or additive float, prepared by
    ``attn.prepare_attention_mask`` to ``[B*heads, S_q or 1, S_kv]`` and viewed as
    ``[B, heads, S_q or 1, S_kv]``). The attention itself runs as ``lz.attention`` on ``q: [B, heads, S, D]``,
    ``k, v: [B, heads, S_kv, D]`` (``layout="BHSD"``). Returns a tensor of ``hidden_states``' shape and dtype.

    Extra positional arguments or ``scale=`` (deprecated in diffusers) are ignored with a ``FutureWarning``,
    as ``AttnProcessor2_0`` does.

    Raises:
        What ``lz.attention`` raises for its inputs (``InvalidInputError`` for malformed tensors,
        ``NoKernelFoundError`` when no kernel can run them).

    >>> from layerzero.integrations.diffusers import LayerZeroAttnProcessor   # doctest: +SKIP
    >>> unet.set_attn_processor(LayerZeroAttnProcessor())                      # doctest: +SKIP
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if args or kwargs.get("scale") is not None:
            # AttnProcessor2_0 ignores it with a deprecation warning; do the same, loudly
            warnings.warn(
                "LayerZeroAttnProcessor: the `scale` argument is deprecated in diffusers and ignored (as "
                "AttnProcessor2_0 does); pass it through the pipeline's cross_attention_kwargs",
                FutureWarning,
                stacklevel=2,
            )
        residual = hidden_states
        if getattr(attn, "spatial_norm", None) is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            # [B*heads, S_q or 1, S_kv] -> [B, heads, S_q or 1, S_kv] (BHSD-broadcastable)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if getattr(attn, "group_norm", None) is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if getattr(attn, "norm_q", None) is not None:
            query = attn.norm_q(query)
        if getattr(attn, "norm_k", None) is not None:
            key = attn.norm_k(key)

        hidden_states = lz_ops.attention(
            query, key, value, attn_mask=attention_mask, is_causal=False, dropout_p=0.0, layout="BHSD"
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)  # linear projection
        hidden_states = attn.to_out[1](hidden_states)  # dropout

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor

    def __repr__(self) -> str:
        return "LayerZeroAttnProcessor()"
