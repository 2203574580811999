"""Paged attention of one layer: write the new K/V into the layer's block pool, attend over the pool."""

from __future__ import annotations

import torch

import layerzero as lz

from ..runner.forward_batch import ForwardBatch

__all__ = ["paged_attention"]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    batch: ForwardBatch, scale: float) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, kv_cache ``[N, 2, P, Hkv, D]`` (NHD) -> ``[T, Hq, D]``: the new
    tokens' K/V go to their slots (:func:`layerzero.reshape_and_cache`), then causal attention of each
    sequence's new tokens over its whole KV (:func:`layerzero.paged_attention`, prefill, chunked prefill and
    decode in one call)."""
    lz.reshape_and_cache(k, v, kv_cache, batch.slot_mapping)
    return lz.paged_attention(q, kv_cache, batch.block_tables, batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q,
                              scale=scale, is_causal=True)
