"""The per-item work of ``triton.paged_prefill_lse``'s kernel (private; imported by ``_cascade_kernels`` only
after ``import triton`` succeeded): :func:`_rows`, one work item's query rows (a token tile of one sequence
times the query heads of one KV head) over its KV split, online softmax in float32, base 2, stored as the
output and its lse (or, with ``SPLIT``, as a float32 partial and its base-2 lse), and :func:`_tile`, one
online-softmax step over a ``BLOCK_N``-position K / V tile (gathered with ``_paged_tiles.kv_tile``) with the
bottom-right causal mask. Split from ``_cascade_kernels.py`` (``paged_prefill`` and its work-item search),
which imports :func:`_rows`: a ``@triton.jit`` function finds the functions it calls through its module's
globals."""

from __future__ import annotations

import triton
import triton.language as tl

from ._paged_tiles import kv_tile

LN2 = tl.constexpr(0.6931471805599453)
"""ln 2 inside ``@triton.jit`` code (globals read there must be ``tl.constexpr`` instances)."""


@triton.jit
def _rows(
    m,
    b,
    h,
    s,
    q0,
    q_len,
    kv_len,
    start,
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
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERPRET: tl.constexpr,
    MAX_TILES: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Token tile m of sequence b, KV head h: its rows over KV positions ``[start, start + split_len)`` (split
    s)."""
    first = m * tokens_per_tile
    stop = kv_len
    if CAUSAL:
        stop = tl.minimum(kv_len, kv_len - q_len + tl.minimum(first + tokens_per_tile, q_len))
    stop = tl.minimum(stop, start + split_len)
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    tok = first + r // group
    row_ok = (r < tokens_per_tile * group) & (tok < q_len)
    heads = h * group + r % group
    q = tl.load(
        q_ptr + (q0 + tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    limit = kv_len - q_len + tok  # causal: the last key each row sees
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    kv_head = kv_ptr + h * stride_head
    bt_row = bt_ptr + b * stride_bt
    if INTERPRET:
        for i in range(0, MAX_TILES):
            t0 = start + i * BLOCK_N
            if t0 < stop:
                m_i, l_i, acc = _tile(
                    q,
                    kv_head,
                    bt_row,
                    t0,
                    stop,
                    limit,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    ks,
                    vs,
                    stride_blk,
                    stride_kv,
                    stride_pos,
                    page,
                    HEAD_DIM,
                    D_PAD,
                    BLOCK_N,
                    CAUSAL,
                    UPCAST,
                    QUANT,
                )
    else:
        for t0 in range(start, stop, BLOCK_N):
            m_i, l_i, acc = _tile(
                q,
                kv_head,
                bt_row,
                t0,
                stop,
                limit,
                m_i,
                l_i,
                acc,
                qk_scale,
                ks,
                vs,
                stride_blk,
                stride_kv,
                stride_pos,
                page,
                HEAD_DIM,
                D_PAD,
                BLOCK_N,
                CAUSAL,
                UPCAST,
                QUANT,
            )
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    rows = (q0 + tok).to(tl.int64)
    if SPLIT:
        ws = (rows * num_heads + heads) * max_splits + s  # workspace row of (token, head, split)
        tl.store(o_ptr + ws[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + ws, lse2, mask=row_ok)
    else:
        tl.store(
            o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(lse_ptr + rows * num_heads + heads, lse2 * LN2, mask=row_ok)


@triton.jit
def _tile(
    q,
    kv_head,
    bt_row,
    t0,
    stop,
    limit,
    m_i,
    l_i,
    acc,
    qk_scale,
    ks,
    vs,
    stride_blk,
    stride_kv,
    stride_pos,
    page,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One online-softmax step over KV positions ``[t0, t0 + BLOCK_N)`` clipped to ``stop`` (and, when
    ``CAUSAL``, to each row's ``limit``); a row with no key seen yet keeps m = -inf and weight 0 (no NaN).
    ``QUANT``: the cache holds float8_e4m3fn / int8 codes, dequantized as ``code * scale`` in float32 and
    rounded to q's dtype (as ``torch_sdpa.paged_attention`` reads them), so both dots keep q's dtype."""
    pos, p_ok, k, v = kv_tile(
        kv_head, bt_row, t0, stop, stride_blk, stride_kv, stride_pos, page, HEAD_DIM, D_PAD, BLOCK_N
    )
    if QUANT:
        k = (k.to(tl.float32) * ks).to(q.dtype)
        v = (v.to(tl.float32) * vs).to(q.dtype)
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [ROWS, BLOCK_N], base-2 logits
    ok = p_ok[None, :]
    if CAUSAL:
        ok = ok & (pos[None, :] <= limit[:, None])
    scores = tl.where(ok, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc
