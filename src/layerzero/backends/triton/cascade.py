"""Cascade attention's Triton kernels: ``triton.paged_prefill_lse`` (op ``paged_attention_lse``: paged attention of
many query tokens per sequence, causal or not, with the lse) and ``triton.merge_attention_states``.

``paged_prefill_lse`` is FlashAttention's forward (Dao et al. 2022) over a paged cache: one program per (sequence,
KV head, tile of new tokens) holds those tokens' query rows for every query head of the KV head (the GQA group) and
reads the sequence's KV once per tile. Cascade attention's shared level (Ye et al. 2024, FlashInfer's
``MultiLevelCascadeAttentionWrapper``) calls it with ``is_causal=False`` and one "sequence" per group of requests
sharing a prefix: the group's decode queries are that sequence's tokens, the prefix its KV, so the prefix is read
once per group instead of once per request. The ``@triton.jit`` code is in ``_cascade_kernels.py``.

Graph-safe: grids and arguments come from shapes (``T``, the number of query tokens, bounds every q_len), no host read
of ``seq_lens`` / ``cu_seqlens_q`` / ``block_tables``. The kernel is persistent (at most 4 programs per SM walking the
work items): items past a sequence's q_len or keys are skipped in O(1) and the outputs start as their "no key"
values, because the engine's CUDA graphs call it with one sequence per batch row, most of them empty.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.kv_layout import KV_LAYOUTS, cache_dims, nhd_view
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, missing, next_pow2
from ._launch import launch
from .paged import sm_count

PREFILL_KERNEL_ID = "triton.paged_prefill_lse"
MERGE_KERNEL_ID = "triton.merge_attention_states"
PREFILL_PRIORITY = 30
"""Below ``triton.paged_decode_lse`` (40, split-K for decode) and FlashInfer (50); above the reference."""
ROWS = 64
"""Query rows (tokens x GQA group) per program."""
SPLIT_TOKENS = 512
"""Split-K: a split covers about this many KV positions (at most ``MAX_SPLITS``), when the call has at most
``SPLIT_MAX_TOKENS`` query tokens (cascade attention's shared level: a few long prefixes, each read by one tile of
rows, would otherwise run one program per (group, KV head): 128 programs read 128 MB at ~1.3 TB/s on the H200)."""
MAX_SPLITS = 16
SPLIT_MAX_TOKENS = 1024
PROGRAMS_PER_SM = 4
"""The persistent kernel's programs: this many per SM (or one per work item when there are fewer items)."""
MAX_GROUP = 16
HEAD_DIM_MAX = 256

_KERNELS = LazyModule("_cascade_kernels")
_PAGED = LazyModule("_paged_kernels")  # paged_decode_merge merges the splits


def block_n_for(head_dim: int) -> int:
    """KV positions per step: 64 for head dims up to 128, 32 above (a ``[ROWS, D]`` float32 accumulator and the K/V
    tiles stay in registers / shared memory)."""
    return 64 if next_pow2(head_dim) <= 128 else 32


def paged_prefill_lse(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, *,
                      num_splits: int | None = None, block_n: int | None = None):
    """``lz.paged_attention(..., return_lse=True)`` canonical-args entry (see
    :func:`layerzero.ops.paged.prepare`): q ``[T, Hq, D]``, cu_seqlens_q ``[B + 1]`` int32 (None: one token per
    sequence, built on the device), causal aligned bottom-right or none. Returns ``(out [T, Hq, D] in q's dtype,
    lse [T, Hq] float32)``, natural log, -inf and 0 for a row with no key. ``num_splits`` / ``block_n`` force the
    split-K count (:func:`split_for`) and the KV positions per step (tests)."""
    kern = _KERNELS.get()
    t, hq, d = q.shape
    _, page, hkv, _ = cache_dims(kv_cache, kv_layout)
    group = hq // hkv
    batch, width = block_tables.shape
    out = torch.zeros(t, hq, d, dtype=q.dtype, device=q.device)  # rows without keys stay 0 / -inf: the kernel
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)  # skips their work items
    if t == 0 or batch == 0:
        return out, lse
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    tokens = max(1, ROWS // group)
    bn = block_n_for(d) if block_n is None else int(block_n)
    split_len, splits = split_for(t, width * page, bn, num_splits)
    interpret = type(kern.paged_prefill).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 (CPU tests)
    st = nhd_view(kv_cache, kv_layout).stride()  # [N, 2, P, Hkv, D] order whatever the layout
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    d_pad = max(16, next_pow2(d))
    if splits > 1:  # float32 partials [T, Hq, S, D] (0) and base-2 lse [T, Hq, S] (-inf): skipped splits weigh 0
        dst = torch.zeros(t * hq * splits * d, dtype=torch.float32, device=q.device)
        dst_lse = torch.full((t * hq * splits,), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        dst, dst_lse = out, lse
    m_tiles = -(-t // tokens)
    total = batch * hkv * splits
    programs = min(total, PROGRAMS_PER_SM * sm_count(q.device))
    launch(kern.paged_prefill, (programs,),
           q, kv_cache, block_tables, seq_lens, cu_seqlens_q, dst, dst_lse, scale * kern.LOG2E,
           q.stride(0), q.stride(1), st[0], st[1], st[2], st[3], block_tables.stride(0), out.stride(0),
           out.stride(1), page, group, tokens, hq, split_len, splits, hkv, m_tiles, total,
           ROWS=max(16, next_pow2(tokens * group)), HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=bn,
           CAUSAL=bool(is_causal), INTERPRET=interpret, MAX_TILES=split_len // bn if interpret else 0,
           MAX_ITEMS=-(-total // programs) if interpret else 0, UPCAST=interpret and q.dtype == torch.bfloat16,
           SPLIT=splits > 1, MAX_M=m_tiles if interpret else 0, num_warps=4)
    if splits > 1:
        launch(_PAGED.get().paged_decode_merge, (t, hq), dst, dst_lse, out, lse, out.stride(0), out.stride(1),
               hq * splits * d, splits * d, d, hq, splits, HEAD_DIM=d, D_PAD=d_pad, S_PAD=next_pow2(splits),
               WRITE_LSE=True, num_warps=4)
    return out, lse


def split_for(num_tokens: int, max_kv_len: int, block_n: int, num_splits: int | None = None) -> tuple[int, int]:
    """Split-K sizing from shapes only: ``(split_len, num_splits)``, ``split_len`` in tokens (a multiple of
    ``block_n``), ``num_splits * split_len >= max_kv_len``. One split above :data:`SPLIT_MAX_TOKENS` query tokens
    (prefill: the token tiles fill the GPU, and the workspace would grow with T); else one per
    :data:`SPLIT_TOKENS` positions, at most :data:`MAX_SPLITS`. ``num_splits`` forces a count (tests).

    >>> split_for(256, 2400, 64)    # the engine's shared level: 5 splits of 512 positions
    (512, 5)
    >>> split_for(4096, 2400, 64)   # a prefill: no split
    (2432, 1)
    """
    tiles = max(1, -(-max_kv_len // block_n))
    if num_splits is None:
        num_splits = 1 if num_tokens > SPLIT_MAX_TOKENS else -(-max_kv_len // SPLIT_TOKENS)
    splits = max(1, min(int(num_splits), MAX_SPLITS, tiles))
    split_len = -(-tiles // splits) * block_n
    return split_len, -(-tiles * block_n // split_len)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """``lz.merge_attention_states`` canonical-args entry: out ``[T, H, D]`` (any strides with a unit last one),
    lse ``[T, H]`` float32 with unit stride over heads. Returns ``(out [T, H, D] in out_a's dtype, lse [T, H]
    float32)``."""
    kern = _KERNELS.get()
    t, h, d = out_a.shape
    out = torch.empty(t, h, d, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=out_a.device)
    if t == 0:
        return out, lse
    la, lb = (x if x.stride(-1) == 1 else x.contiguous() for x in (lse_a, lse_b))
    launch(kern.merge_states, (t,), out_a, la, out_b, lb, out, lse, out_a.stride(0), out_a.stride(1),
           out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1), la.stride(0), lb.stride(0), h,
           HEAD_DIM=d, D_PAD=max(16, next_pow2(d)), H_PAD=next_pow2(h), num_warps=4)
    return out, lse


def prefill_check(ctx: SelectionContext) -> list[Reason]:
    """What data cannot say for ``triton.paged_prefill_lse``: GQA ratio <= 16, a paged layout, a page size >= 1."""
    out = []
    ratio = ctx.gqa_ratio
    if ratio is not None and ratio > MAX_GROUP:
        out.append(Reason(ReasonCode.GQA_RATIO_INVALID, f"Hq / Hkv = {ratio} > {MAX_GROUP} (one GQA group per tile)"))
    if ctx.kv_layout not in KV_LAYOUTS:
        out.append(Reason(ReasonCode.KV_LAYOUT_UNSUPPORTED, f"kv_layout {ctx.kv_layout!r} is not NHD or HND"))
    if ctx.page_size is not None and ctx.page_size < 1:
        out.append(Reason(ReasonCode.SHAPE_MISMATCH, f"page size {ctx.page_size} < 1"))
    return out


def merge_check(ctx: SelectionContext) -> list[Reason]:
    """``triton.merge_attention_states`` holds every head of a row in one tile: at most 256 heads x head dim 256."""
    if (ctx.num_heads_q or 1) * next_pow2(ctx.head_dim or 1) > 256 * 256:
        return [Reason(ReasonCode.HEAD_DIM_TOO_LARGE, f"{ctx.num_heads_q} heads x head dim {ctx.head_dim} > one "
                                                          "[256, 256] tile")]
    return []


def kernel_specs(available: bool, why: str) -> list[KernelSpec]:
    """``[triton.paged_prefill_lse, triton.merge_attention_states]`` (CUDA SM >= 8.0, fp16/bf16/fp32, graph-safe,
    deterministic); when ``available`` is False their callables raise ``BackendNotAvailableError`` with ``why``."""
    common: dict[str, Any] = dict(device_types=CUDA, dtypes=FLOATS, sm_min=SM_MIN, supports_backward=False,
                                  supports_dropout=False, deterministic=True, graph_safe=True)
    return [
        KernelSpec(PREFILL_KERNEL_ID, "paged_attention_lse",
                   paged_prefill_lse if available else missing(PREFILL_KERNEL_ID, why), priority=PREFILL_PRIORITY,
                   description="Triton paged attention of many query tokens per sequence (FlashAttention forward "
                               "over pages, GQA group and token tile as one tile), causal or not, with the lse: "
                               "cascade attention's shared level",
                   head_dim_min=1, head_dim_max=HEAD_DIM_MAX, check=prefill_check, **common),
        KernelSpec(MERGE_KERNEL_ID, "merge_attention_states",
                   merge_attention_states if available else missing(MERGE_KERNEL_ID, why), priority=PREFILL_PRIORITY,
                   description="Triton merge of two attention states (one program per row, all heads as one tile)",
                   check=merge_check, **common),
    ]
