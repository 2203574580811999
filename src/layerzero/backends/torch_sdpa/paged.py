"""Paged attention through ``scaled_dot_product_attention`` (the cache write lives in
``backends/torch_native/cache.py``).

- ``torch_sdpa.paged_attention``: decode gathers every sequence's blocks at once into a padded
  ``[B, Hkv, L, D]`` (L = the longest sequence rounded up to whole blocks), zeroes the padding (so NaN in
  unused slots cannot leak through ``0 * NaN``) and makes one SDPA call with a key-padding bool mask and
  ``enable_gqa``; prefill/append gathers each sequence into ``[1, Hkv, kv_len, D]`` and calls SDPA with an
  explicit bottom-right causal bool mask (``is_causal=True`` when q_len == kv_len, where both alignments
  agree). Reads index values on the host (``.tolist()`` / ``max``), so not CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerzero.core.context import SelectionContext
from layerzero.core.kv_layout import cache_dims, nhd_view
from layerzero.core.kv_quant import KV_QUANT_DTYPES, dequantize_kv
from layerzero.core.reasons import Reason
from layerzero.core.specs import KernelSpec

from .kernels import amx_below_avx512

_SDPA = F.scaled_dot_product_attention
FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def _read(codes, kv_scale, dtype):
    """Gathered cache entries -> q's dtype: a quantized cache's codes are dequantized
    (``codes.float() * scale``, float64 for float64 queries), an unquantized cache's are returned as they
    are."""
    if codes.dtype not in KV_QUANT_DTYPES:
        return codes
    return dequantize_kv(codes, kv_scale, torch.float64 if dtype == torch.float64 else torch.float32).to(
        dtype
    )


def _decode(q, kv_cache, block_tables, seq_lens, scale, layout, k_scale, v_scale):
    """One query token per sequence: padded gather + one masked SDPA call. q ``[B, Hq, D]``."""
    b, hq, d = q.shape
    _, p, hkv, _ = cache_dims(kv_cache, layout)
    lens = seq_lens.long()
    nblk = (int(lens.max()) + p - 1) // p
    used = torch.arange(nblk, device=q.device) * p < lens[:, None]  # [B, nblk]
    ids = torch.where(used, block_tables[:, :nblk].long(), 0)  # unread entries may hold padding ids
    blocks = nhd_view(kv_cache, layout)[ids]  # [B, nblk, 2, P, Hkv, D]
    valid = torch.arange(nblk * p, device=q.device) < lens[:, None]  # [B, L]
    keep = valid[:, :, None, None]
    k = _read(blocks[:, :, 0].reshape(b, nblk * p, hkv, d), k_scale, q.dtype)
    v = _read(blocks[:, :, 1].reshape(b, nblk * p, hkv, d), v_scale, q.dtype)
    k = torch.where(keep, k, 0).transpose(1, 2)  # [B, Hkv, L, D]
    v = torch.where(keep, v, 0).transpose(1, 2)
    out = _SDPA(
        q[:, :, None, :], k, v, valid[:, None, None, :], 0.0, False, scale=scale, enable_gqa=hq != hkv
    )
    return out[:, :, 0, :]


def _gather(cache, block_row, kv_len, p, hkv, d):
    """One sequence's K and V as ``[1, Hkv, kv_len, D]`` (only the used blocks and slots) from ``cache``, the
    :func:`nhd_view` of the cache."""
    nblk = (kv_len + p - 1) // p
    blocks = cache[block_row[:nblk].long()]  # [nblk, 2, P, Hkv, D]
    k = blocks[:, 0].reshape(nblk * p, hkv, d)[:kv_len]
    v = blocks[:, 1].reshape(nblk * p, hkv, d)[:kv_len]
    return k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def paged_attention(
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None, v_scale=None
):
    """``lz.paged_attention`` through SDPA (canonical args, see :func:`layerzero.ops.paged.prepare`); a
    quantized cache (float8_e4m3fn / int8) is dequantized to q's dtype after the gather (only the used
    blocks). q ``[T, Hq, D]`` -> ``[T, Hq, D]`` in q's dtype."""
    num_tokens, hq, d = q.shape
    if num_tokens == 0:
        return q.new_empty(0, hq, d)
    if cu_seqlens_q is None:
        return _decode(q, kv_cache, block_tables, seq_lens, scale, kv_layout, k_scale, v_scale)
    _, p, hkv, dk = cache_dims(kv_cache, kv_layout)
    cache = nhd_view(kv_cache, kv_layout)
    starts = cu_seqlens_q.tolist()
    pieces = []
    for s, kv_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        k, v = _gather(cache, block_tables[s], kv_len, p, hkv, dk)
        k, v = _read(k, k_scale, q.dtype), _read(v, v_scale, q.dtype)
        qs = q[q0:q1].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        mask, causal = None, False
        if is_causal and q_len > 1:
            if q_len == kv_len:
                causal = True
            else:
                i = torch.arange(q_len, device=q.device)[:, None]
                mask = torch.arange(kv_len, device=q.device)[None, :] <= kv_len - q_len + i
        out = _SDPA(qs, k, v, mask, 0.0, causal, scale=scale, enable_gqa=hq != k.shape[1])
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces)


def _check(ctx: SelectionContext) -> list[Reason]:
    """Refuses bfloat16 on an AMX CPU whose ATen dispatch is forced below AVX-512, where SDPA's CPU flash
    kernel raises (``kernels.amx_below_avx512``)."""
    reason = amx_below_avx512(ctx)
    return [] if reason is None else [reason]


def kernel_specs() -> list[KernelSpec]:
    """KernelSpecs of the paged kernels: priority 10 (above the reference's 0), CPU and CUDA, all floats."""
    common = dict(
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=FLOATS,
        deterministic=True,
        kv_cache_dtypes=KV_QUANT_DTYPES,
    )
    return [
        KernelSpec(
            "torch_sdpa.paged_attention",
            "paged_attention",
            paged_attention,
            priority=10,
            description="paged attention: gather KV per sequence (padded batch for decode) + SDPA",
            graph_safe=False,
            check=_check,
            **common,
        ),
    ]
