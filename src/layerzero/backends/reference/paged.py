"""Reference paged-KV kernels: paged attention as an explicit loop over sequences in float32 (float64 for
float64 inputs), and reshape_and_cache as a loop over tokens. Written for clarity: they are the oracle of
the other paged kernels and the last fallback (vLLM PagedAttention semantics, Kwon et al. 2023).

Both read index values on the host (``.tolist()``), so they sync a GPU and are not CUDA-graph safe.
"""

from __future__ import annotations

import math

import torch

from layerzero.core.kv_layout import KVLayout, cache_dims, nhd_view
from layerzero.core.kv_quant import KV_QUANT_DTYPES, dequantize_kv, quantize_kv
from layerzero.core.specs import KernelSpec


def gather_kv(
    kv_cache: torch.Tensor, block_row: torch.Tensor, kv_len: int, layout: KVLayout | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence, each ``[kv_len, Hkv, D]`` in the cache's dtype.

    ``kv_cache`` is ``[N, 2, P, Hkv, D]`` (``layout`` NHD) or ``[N, 2, Hkv, P, D]`` (HND); ``block_row`` the
    sequence's row of ``block_tables`` (int32 ``[M]``); only its first ``ceil(kv_len / P)`` ids are read, and
    cache slots past ``kv_len`` are cut off before any arithmetic (so NaN there never leaks).
    """
    _, p, hkv, d = cache_dims(kv_cache, layout)
    nblk = (kv_len + p - 1) // p
    blocks = nhd_view(kv_cache, layout)[block_row[:nblk].long()]  # [nblk, 2, P, Hkv, D]
    k = blocks[:, 0].reshape(nblk * p, hkv, d)[:kv_len]
    v = blocks[:, 1].reshape(nblk * p, hkv, d)[:kv_len]
    return k, v


def paged_attention(
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None, v_scale=None
):
    """Reference ``lz.paged_attention`` (canonical args, see :func:`layerzero.ops.paged.prepare`): for each
    sequence gather its K/V from its blocks, then softmax attention in float32 with GQA by repeating KV heads
    and bottom-right causal alignment. A quantized cache (float8_e4m3fn / int8) is read as ``codes * k_scale``
    / ``codes * v_scale`` in the working dtype. q ``[T, Hq, D]`` -> ``[T, Hq, D]`` in q's dtype."""
    return _attend(
        q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale, v_scale
    )[0]


def paged_attention_lse(
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None, v_scale=None
):
    """Reference ``lz.paged_attention(..., return_lse=True)``: :func:`paged_attention` and each row's
    natural-log sum-exp of its scaled scores ``[T, Hq]`` float32 (float64 for float64 q); -inf and a zero row
    where a row attends no key."""
    return _attend(
        q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale, v_scale
    )


def _attend(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale, v_scale):
    """``(out [T, Hq, D] in q's dtype, lse [T, Hq] float32, float64 for float64 q)`` of the canonical args."""
    num_tokens, hq, d = q.shape
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    lens = seq_lens.tolist()
    starts = cu_seqlens_q.tolist() if cu_seqlens_q is not None else list(range(len(lens) + 1))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(num_tokens, hq, d, dtype=work, device=q.device)
    lse = torch.full((num_tokens, hq), float("-inf"), dtype=work, device=q.device)
    for s, kv_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0 or kv_len == 0:
            continue
        k, v = gather_kv(kv_cache, block_tables[s], kv_len, kv_layout)
        group = hq // k.shape[1]
        k = dequantize_kv(k, k_scale, work).repeat_interleave(group, dim=1)  # [kv_len, Hq, D]
        v = dequantize_kv(v, v_scale, work).repeat_interleave(group, dim=1)
        qs = q[q0:q1].to(work)  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [Hq, q_len, kv_len]
        if is_causal:
            i = torch.arange(q_len, device=q.device)[:, None]
            j = torch.arange(kv_len, device=q.device)[None, :]
            scores = scores.masked_fill(j > kv_len - q_len + i, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, q_len]; -inf for a row with every key masked
        probs = torch.exp(scores - torch.where(row_lse.isinf(), 0.0, row_lse)[..., None])
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v)
        lse[q0:q1] = row_lse.T
    return out.to(q.dtype), lse


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Reference ``lz.merge_attention_states`` in float32 (float64 for float64 lse): weights
    ``exp(lse - max)``, rows with both lse -inf give 0 and -inf. Returns ``(out in out_a's dtype, lse in
    lse_a's dtype)``."""
    work = torch.float64 if lse_a.dtype == torch.float64 else torch.float32
    la, lb = lse_a.to(work), lse_b.to(work)
    m = torch.maximum(la, lb)
    m = torch.where(m == float("-inf"), 0.0, m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    part_a = torch.where(
        wa[..., None] > 0, out_a.to(work) * wa[..., None], 0.0
    )  # weight 0: nothing, even NaN
    part_b = torch.where(wb[..., None] > 0, out_b.to(work) * wb[..., None], 0.0)
    out = (part_a + part_b) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, m + torch.log(total), float("-inf"))
    return out.to(out_a.dtype), lse.to(lse_a.dtype)


def reshape_and_cache(k, v, kv_cache, slot_mapping, kv_layout, k_scale=None, v_scale=None):
    """Reference ``lz.reshape_and_cache``: token by token, write k[t]/v[t] ``[Hkv, D]`` at block
    ``slot // P``, offset ``slot % P`` of ``kv_cache`` in place; slot -1 skips the token. A quantized cache
    gets ``round_to_format(k / k_scale)`` (:func:`~layerzero.core.kv_quant.quantize_kv`). Returns None."""
    if kv_cache.dtype in KV_QUANT_DTYPES:
        k, v = quantize_kv(k, k_scale, kv_cache.dtype), quantize_kv(v, v_scale, kv_cache.dtype)
    _, p, _, _ = cache_dims(kv_cache, kv_layout)
    cache = nhd_view(kv_cache, kv_layout)  # a view: the writes land in kv_cache
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, p)
        cache[block, 0, offset] = k[t]
        cache[block, 1, offset] = v[t]


def kernel_specs(common: dict) -> list[KernelSpec]:
    """The reference paged kernels with the reference backend's ``common`` constraints; not graph-safe
    (host reads of index values)."""
    return [
        KernelSpec(
            "reference.paged_attention",
            "paged_attention",
            paged_attention,
            description="reference paged attention (loop over sequences, float32 math)",
            **{**common, "graph_safe": False, "kv_cache_dtypes": KV_QUANT_DTYPES},
        ),
        KernelSpec(
            "reference.paged_attention_lse",
            "paged_attention_lse",
            paged_attention_lse,
            description="reference paged attention + log-sum-exp (loop over sequences, float32 math)",
            **{**common, "graph_safe": False, "kv_cache_dtypes": KV_QUANT_DTYPES},
        ),
        KernelSpec(
            "reference.merge_attention_states",
            "merge_attention_states",
            merge_attention_states,
            description="reference merge of two attention states (float32 math)",
            **common,
        ),
        KernelSpec(
            "reference.reshape_and_cache",
            "reshape_and_cache",
            reshape_and_cache,
            description="reference paged KV cache write (loop over tokens)",
            **{**common, "graph_safe": False, "kv_cache_dtypes": KV_QUANT_DTYPES},
        ),
    ]
