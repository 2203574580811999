"""The ``@triton.jit`` code of ``triton.paged_prefill_lse`` and ``triton.merge_attention_states`` (private;
imported by :mod:`.cascade` on a kernel's first call, after ``import triton`` succeeded).

``paged_prefill``, a persistent grid over work items (sequence b, token tile m, split s, KV head h) that it
derives on the device: item (b, m, h) holds the query rows of ``tokens_per_tile`` consecutive new tokens of
sequence b times the ``group = Hq / Hkv`` query heads of KV head h as one ``[ROWS, D_PAD]`` tile (row r: token
``m * tokens_per_tile + r // group``, head ``h * group + r % group``), so the KV of a sequence is read once
per tile for every query head sharing it. It runs FlashAttention's online softmax (Dao et al. 2022; float32,
base 2) over the sequence's KV positions, gathered through ``block_tables`` at any page size, with the
bottom-right causal mask when ``CAUSAL`` (row token i of q_len sees keys ``j <= kv_len - q_len + i``) or none
(cascade attention's shared level: every member's query sees the whole shared prefix). It stores the
normalized output in the output's dtype and the natural-log lse (``-inf`` and 0 for a row that saw no key).
Split-K (``SPLIT``, FlashDecoding's scheme for few long sequences): a tile's KV positions are cut into splits
sized on the device from the call's total work, each writing a float32 partial and its base-2 lse;
``_paged_kernels.paged_decode_merge`` (one program per (token, head)) merges them.

``merge_states``, grid ``(T,)``: one program per row merges two attention states of all heads
(``[H_PAD, D_PAD]``) with weights ``exp(lse - max)`` (FlashInfer's ``merge_state``).

This module holds ``paged_prefill`` and its work-item search (``_tiles``, ``_item``); each item's rows and
online-softmax steps are in ``_cascade_tiles.py`` (``_rows``, ``_tile``), ``merge_states`` in
``_merge_states_kernels.py``, imported here (re-exported: the launcher reaches both kernels through this
module).

Nothing reads a device value on the host: grids and launch arguments come from shapes (graph-safe).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._cache_kernels import load_scale
from ._cascade_tiles import _rows
from ._merge_states_kernels import merge_states  # noqa: F401 - re-exported (cascade launches it from here)

LOG2E = 1.4426950408889634
"""log2(e), a host float (the softmax scale is multiplied by it before the launch)."""


@triton.jit(
    do_not_specialize=[
        "stride_bt",
        "page",
        "group",
        "tokens_per_tile",
        "num_heads",
        "num_kv_heads",
        "num_seqs",
        "target",
        "min_split_tiles",
        "max_splits",
    ]
)
def paged_prefill(
    q_ptr,
    kv_ptr,
    bt_ptr,
    lens_ptr,
    cu_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    k_scale,
    v_scale,  # a quantized cache's scales: floats, or pointers to one float32 (K_PTR / V_PTR)
    stride_qt,
    stride_qh,
    stride_blk,
    stride_kv,
    stride_pos,
    stride_head,
    stride_bt,
    stride_ot,
    stride_oh,
    page,
    group,
    tokens_per_tile,
    num_heads,
    num_kv_heads,
    num_seqs,
    target,
    min_split_tiles,
    max_splits,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    B_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERPRET: tl.constexpr,
    MAX_TILES: tl.constexpr,
    MAX_ITEMS: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
    QUANT: tl.constexpr = False,
    K_PTR: tl.constexpr = False,
    V_PTR: tl.constexpr = False,
):
    """See the module docstring. Persistent: every program first derives the work items from ``cu_seqlens_q``
    and ``seq_lens`` (``[B_PAD]`` vectors, no host read): sequence b has
    ``mt_b = ceil(q_len_b / tokens_per_tile)`` token tiles (0 without keys) and, with ``SPLIT``, ``sp_b =
    min(ceil(kv_tiles_b / per), max_splits)`` KV splits, where ``per = max(min_split_tiles, ceil(sum_b mt_b *
    kv_tiles_b * Hkv /
    target))`` KV tiles balances the work over about ``target`` items; then program p takes items ``p, p + P,
    ...`` of the ``sum_b mt_b * sp_b * Hkv`` items ((sequence, token tile, split) major, KV head innermost:
    the heads of one tile in adjacent programs, which read the same cache rows), each found by a prefix-sum
    search. Empty sequences and padded rows cost nothing, and a group with many query tokens spreads over many
    programs (one tile each).

    Strides in elements. Without ``SPLIT``: ``o_ptr`` is the output (its dtype, strides ``stride_ot`` /
    ``stride_oh``), ``lse_ptr`` a contiguous ``[T, num_heads]`` float32 (natural log), both preset to "no key"
    (0, -inf) by the caller for rows no item covers. With ``SPLIT``: ``o_ptr`` is the float32 workspace
    ``[T, Hq, max_splits, D]`` and ``lse_ptr`` its ``[T, Hq, max_splits]`` base-2 lse (preset to -inf: unused
    slots weigh 0), merged by ``_paged_kernels.paged_decode_merge``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ks = load_scale(k_scale, K_PTR)
    vs = load_scale(v_scale, V_PTR)
    m_tiles, kv_tiles = _tiles(cu_ptr, lens_ptr, num_seqs, tokens_per_tile, B_PAD, BLOCK_N)
    per = 1
    if SPLIT:
        per = tl.maximum(min_split_tiles, tl.cdiv(tl.sum(m_tiles * kv_tiles, 0) * num_kv_heads, target))
        total = tl.sum(m_tiles * tl.minimum(tl.cdiv(kv_tiles, per), max_splits), 0) * num_kv_heads
    else:
        total = tl.sum(m_tiles, 0) * num_kv_heads
    if INTERPRET:  # the CPU interpreter cannot loop over runtime bounds: a fixed trip count
        for i in range(0, MAX_ITEMS):
            w = pid + i * nprog
            if w < total:
                _item(
                    w,
                    per,
                    q_ptr,
                    kv_ptr,
                    bt_ptr,
                    lens_ptr,
                    cu_ptr,
                    o_ptr,
                    lse_ptr,
                    qk_scale,
                    ks,
                    vs,
                    stride_qt,
                    stride_qh,
                    stride_blk,
                    stride_kv,
                    stride_pos,
                    stride_head,
                    stride_bt,
                    stride_ot,
                    stride_oh,
                    page,
                    group,
                    tokens_per_tile,
                    num_heads,
                    num_kv_heads,
                    num_seqs,
                    max_splits,
                    ROWS,
                    HEAD_DIM,
                    D_PAD,
                    BLOCK_N,
                    B_PAD,
                    CAUSAL,
                    INTERPRET,
                    MAX_TILES,
                    UPCAST,
                    SPLIT,
                    QUANT,
                )
    else:
        for w in range(pid, total, nprog):
            _item(
                w,
                per,
                q_ptr,
                kv_ptr,
                bt_ptr,
                lens_ptr,
                cu_ptr,
                o_ptr,
                lse_ptr,
                qk_scale,
                ks,
                vs,
                stride_qt,
                stride_qh,
                stride_blk,
                stride_kv,
                stride_pos,
                stride_head,
                stride_bt,
                stride_ot,
                stride_oh,
                page,
                group,
                tokens_per_tile,
                num_heads,
                num_kv_heads,
                num_seqs,
                max_splits,
                ROWS,
                HEAD_DIM,
                D_PAD,
                BLOCK_N,
                B_PAD,
                CAUSAL,
                INTERPRET,
                MAX_TILES,
                UPCAST,
                SPLIT,
                QUANT,
            )


@triton.jit
def _tiles(cu_ptr, lens_ptr, num_seqs, tokens_per_tile, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[B_PAD]`` token tiles and KV tiles of every sequence (0 token tiles for a sequence without keys)."""
    bi = tl.arange(0, B_PAD)
    b_ok = bi < num_seqs
    q_lens = tl.load(cu_ptr + bi + 1, mask=b_ok, other=0) - tl.load(cu_ptr + bi, mask=b_ok, other=0)
    kv_tiles = tl.cdiv(tl.load(lens_ptr + bi, mask=b_ok, other=0), BLOCK_N)
    return tl.where(kv_tiles > 0, tl.cdiv(q_lens, tokens_per_tile), 0), kv_tiles


@triton.jit
def _item(
    w,
    per,
    q_ptr,
    kv_ptr,
    bt_ptr,
    lens_ptr,
    cu_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,
    ks,
    vs,
    stride_qt,
    stride_qh,
    stride_blk,
    stride_kv,
    stride_pos,
    stride_head,
    stride_bt,
    stride_ot,
    stride_oh,
    page,
    group,
    tokens_per_tile,
    num_heads,
    num_kv_heads,
    num_seqs,
    max_splits,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    B_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERPRET: tl.constexpr,
    MAX_TILES: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Work item ``w`` = ((sequence b's items before it) + m * sp_b + s) * Hkv + h: token tile m of sequence
    b, KV head h, KV split s (``per`` KV tiles each, the last one shorter; one split covering every key
    without ``SPLIT``). The per-sequence counts are derived again here from two small (cached) vector loads
    rather than carried through the KV loop (the H200 timed both the same; this one ran the GPU tests)."""
    m_tiles, kv_all = _tiles(cu_ptr, lens_ptr, num_seqs, tokens_per_tile, B_PAD, BLOCK_N)
    if SPLIT:
        counts = m_tiles * tl.minimum(tl.cdiv(kv_all, per), max_splits)
    else:
        counts = m_tiles
    h = w % num_kv_heads
    it = w // num_kv_heads
    b = tl.sum((tl.cumsum(counts, 0) <= it).to(tl.int32), 0)  # the first sequence whose prefix sum exceeds it
    local = it - tl.sum(tl.where(tl.arange(0, B_PAD) < b, counts, 0), 0)
    q0 = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q0
    kv_len = tl.load(lens_ptr + b)
    kv_tiles = tl.cdiv(kv_len, BLOCK_N)
    if SPLIT:
        splits = tl.minimum(tl.cdiv(kv_tiles, per), max_splits)
        split_len = tl.cdiv(kv_tiles, splits) * BLOCK_N
        m = local // splits
        s = local % splits
    else:
        split_len = kv_tiles * BLOCK_N
        m = local
        s = 0
    _rows(
        m,
        b,
        h,
        s,
        q0,
        q_len,
        kv_len,
        s * split_len,
        split_len,
        q_ptr,
        kv_ptr,
        bt_ptr,
        o_ptr,
        lse_ptr,
        qk_scale,
        ks,
        vs,
        stride_qt,
        stride_qh,
        stride_blk,
        stride_kv,
        stride_pos,
        stride_head,
        stride_bt,
        stride_ot,
        stride_oh,
        page,
        group,
        tokens_per_tile,
        num_heads,
        max_splits,
        ROWS,
        HEAD_DIM,
        D_PAD,
        BLOCK_N,
        CAUSAL,
        INTERPRET,
        MAX_TILES,
        UPCAST,
        SPLIT,
        QUANT,
    )
