"""Paged attention of one layer: write the new K/V into the layer's block pool, attend over the pool; a
quantized pool (``LLM(kv_cache_dtype="fp8" | "int8")``) is written and read through the layer's
:class:`KVScales`."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

import layerzero as lz

from ..worker.attn_metadata import CascadeBatch, ForwardBatch

__all__ = ["INT8_HEADROOM", "QUANTIZED_KV_DTYPES", "KVScales", "cascade_attention", "paged_attention"]

QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.int8)
INT8_HEADROOM = 1.25
"""int8 pools: the scale is ``INT8_HEADROOM * amax / 127`` of the first prefill's K (V), so later values up to
1.25x that prefill's largest still fit before the [-127, 127] clamp."""


class KVScales(nn.Module):
    """Per-layer ``k_scale`` / ``v_scale`` of a quantized KV pool (vLLM's per-tensor scales): 0-d float32
    buffers, not in the state dict (the loader never sees them), 1.0 until set. ``calibrate`` (set by the
    model runner for int8 pools, after CUDA-graph capture): the next forward through the layer with tokens
    sets both scales from its K/V (``INT8_HEADROOM * amax / 127``, on the device, no host sync) and clears the
    flag; graphs read the buffers in place, so replays see the calibrated values."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.calibrate = False

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Calibrate from the first batch with tokens when asked (see the class docstring)."""
        if not self.calibrate or k.shape[0] == 0:
            return
        tiny = torch.finfo(torch.float32).tiny
        self.k_scale.copy_((k.detach().abs().amax().float() * (INT8_HEADROOM / 127)).clamp_min(tiny))
        self.v_scale.copy_((v.detach().abs().amax().float() * (INT8_HEADROOM / 127)).clamp_min(tiny))
        self.calibrate = False


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, kv_cache ``[N, 2, P, Hkv, D]`` (NHD) -> ``[T, Hq, D]``: the new
    tokens' K/V go to their slots (:func:`layerzero.reshape_and_cache`), then causal attention of each
    sequence's new tokens over its whole KV (:func:`layerzero.paged_attention`, prefill, chunked prefill and
    decode in one call). A float8_e4m3fn / int8 pool is quantized on write and dequantized on read with
    ``kv_scales`` (required then). Under piecewise CUDA graphs (``batch.pieces``) the whole call runs eagerly
    between two captured pieces (:meth:`~layerzero.engine.worker.piecewise.PiecewiseGraphs.attend`)."""
    if batch.pieces is not None:
        return batch.pieces.attend(
            q, k, v, partial(paged_attention, kv_cache=kv_cache, scale=scale, kv_scales=kv_scales)
        )
    if kv_cache.dtype in QUANTIZED_KV_DTYPES:
        kv_scales.observe(k, v)
        ks, vs = kv_scales.k_scale, kv_scales.v_scale
        lz.reshape_and_cache(k, v, kv_cache, batch.slot_mapping, k_scale=ks, v_scale=vs)
        return lz.paged_attention(
            q,
            kv_cache,
            batch.block_tables,
            batch.seq_lens,
            cu_seqlens_q=batch.cu_seqlens_q,
            scale=scale,
            is_causal=True,
            k_scale=ks,
            v_scale=vs,
        )
    lz.reshape_and_cache(k, v, kv_cache, batch.slot_mapping)
    if batch.cascade is not None:
        return cascade_attention(q, kv_cache, batch.cascade, scale)
    return lz.paged_attention(
        q,
        kv_cache,
        batch.block_tables,
        batch.seq_lens,
        cu_seqlens_q=batch.cu_seqlens_q,
        scale=scale,
        is_causal=True,
    )


def cascade_attention(q: torch.Tensor, kv_cache: torch.Tensor, c: CascadeBatch, scale: float) -> torch.Tensor:
    """Attention of the step's new tokens q ``[T, Hq, D]`` as two levels (:mod:`..worker.cascade`), in the
    cascade's token order (``c.rows``, group after group): every token over its group's shared prefix (not
    causal: the prefix read once per group; an empty prefix gives lse -inf) and, causal, over its sequence's
    own blocks (``c.cu_seqlens_q``; one token per sequence in a decode step), merged by log-sum-exp
    (:func:`layerzero.merge_attention_states`), then scattered back to the step's order. Returns
    ``[T, Hq, D]``."""
    qc = q.index_select(0, c.rows)
    own, own_lse = lz.paged_attention(
        qc,
        kv_cache,
        c.suffix_tables,
        c.suffix_lens,
        cu_seqlens_q=c.cu_seqlens_q,
        scale=scale,
        return_lse=True,
    )
    shared, shared_lse = lz.paged_attention(
        qc,
        kv_cache,
        c.prefix_tables,
        c.prefix_lens,
        cu_seqlens_q=c.cu_prefix,
        scale=scale,
        is_causal=False,
        return_lse=True,
    )
    merged, _ = lz.merge_attention_states(shared, shared_lse, own, own_lse)
    return torch.empty_like(merged).index_copy_(0, c.rows, merged)
