"""The ``@triton.jit`` code of ``triton.attention`` (private; imported by :mod:`.attention` on the kernel's
first call, after ``import triton`` succeeded).

``attention_fwd`` is FlashAttention-2's forward (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning"): a program holds a ``[ROWS, D_PAD]`` tile of query rows in registers and
runs the online softmax (float32, base 2) over ``BLOCK_N``-key tiles of K and V, rescaling its float32
accumulator as the row maximum grows, and divides by the row sum once at the end (one rounding to the output
dtype). The ALiBi bias (Press et al. 2022, "Train Short, Test Long"; flash-attn's convention) is computed in
the tile loop from the slopes, ``-slope[b, h] * |i + Sk - Sq - j|``, never materialized. Row r of a tile is
query token ``m * tokens_per_tile + r // sub_group`` of query head ``h0 + r % sub_group``, where the
``sub_group`` heads ``h0 ...`` share one KV head (GQA, Ainslie et al. 2023): K and V are read once for all of
them, and a decode-like call (Sq = 1) fills the tile with heads instead of padding.

Order of operations per score, as ``backends/reference/attention.py``: ``s = scale q.k``; with ``SOFTCAP``
``s = softcap * tanh(s / softcap)``; ``s -= slope * |i + Sk - Sq - j|`` (``ALIBI``); keys outside
``i - left <= j <= i + right`` (``MASK``: lz.attention's top-left causal mask is ``right = 0``, the sliding
window FlashAttention's ``window_size``, both aligned top-left) and ``j >= Sk`` get ``-inf``. A row that sees
no key stores 0 (the reference's rule for fully masked rows).

Split-K (``SPLIT``, FlashDecoding's scheme for calls with few tiles, e.g. decode): program axis 1 is the
split, each split covers a contiguous range of the tile's keys and writes its normalized float32 partial and
base-2 lse to a workspace; ``attention_merge`` (one program per output row) merges them with
``_paged_merge_kernels.merge_row``.

Nothing reads a device value on the host: grids and launch arguments come from shapes (graph-safe).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._paged_merge_kernels import merge_row

LOG2E = 1.4426950408889634
"""log2(e), a host float (the softmax scale is multiplied by it before the launch when there is no
soft-cap)."""
LOG2E_C = tl.constexpr(1.4426950408889634)
"""log2(e) inside ``@triton.jit`` code (globals read there must be ``tl.constexpr`` instances)."""


@triton.jit(
    do_not_specialize=[
        "seq_q",
        "seq_k",
        "num_heads",
        "group",
        "sub_group",
        "tokens_per_tile",
        "token_tiles",
        "left",
        "right",
    ]
)
def attention_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    slopes_ptr,
    ws_ptr,
    ws_lse_ptr,
    qk_scale,  # scale * log2(e) without SOFTCAP; scale / softcap with it
    softcap,  # softcap * log2(e) (read only with SOFTCAP)
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_os,
    stride_ab,
    stride_ah,
    seq_q,
    seq_k,
    num_heads,
    group,
    sub_group,
    tokens_per_tile,
    token_tiles,
    left,
    right,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    MAX_TILES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(token_tiles * B * Hq / sub_group, splits)``; see the module docstring. Program 0 of axis 0
    takes the last token tile of (batch 0, head block 0): token tiles run last-first within a head block
    (under a causal mask the last tiles have the most keys, so they start first), head blocks of one batch row
    are adjacent (their programs read the same K/V rows from L2).

    Strides in elements (q/k/v/o ``[B, H, S, D]`` in any order of memory with a unit last stride; slopes
    ``[B or 1, Hq]`` with ``stride_ab`` 0 for ``[Hq]``). ``left`` / ``right``: the visible keys of query i are
    ``i - left <= j <= i + right`` (with ``MASK``; the host passes ``Sq + Sk`` for an unbounded side and
    ``right = 0`` under causality). Without ``SPLIT`` the normalized output goes to ``o_ptr`` in its dtype;
    with it the float32 partial of split s goes to row ``((b Hq + h) Sq + i) S + s`` of ``ws_ptr``
    (``[rows, Dv]``) and its base-2 lse (-inf: no key seen) to ``ws_lse_ptr``. Lengths, head counts and window
    bounds are not specialized (Triton would compile a variant per divisibility class of each: one per new
    prompt length pattern); strides are (their 16-divisibility lets the K/V row loads vectorize).
    ``INTERPRET``: the interpreter cannot loop over bounds computed in the kernel, so the loop runs
    ``MAX_TILES`` (= ceil(Sk / BLOCK_N)) guarded steps; ``UPCAST``: the interpreter's bfloat16 ``tl.dot`` is
    wrong, so bfloat16 tiles are converted to float32 there."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    m = token_tiles - 1 - pid % token_tiles
    bh = pid // token_tiles
    blocks = num_heads // sub_group
    b = (bh // blocks).to(tl.int64)
    h0 = (bh % blocks) * sub_group
    kvh = (h0 // group).to(tl.int64)
    r = tl.arange(0, ROWS)
    first = m * tokens_per_tile
    tok = first + r // sub_group
    head = h0 + r % sub_group
    row_ok = (r < tokens_per_tile * sub_group) & (tok < seq_q)
    d = tl.arange(0, D_PAD)
    q = tl.load(
        q_ptr
        + b * stride_qb
        + head.to(tl.int64)[:, None] * stride_qh
        + tok.to(tl.int64)[:, None] * stride_qs
        + d[None, :],
        mask=row_ok[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    slope = tl.zeros([ROWS], tl.float32)
    if ALIBI:
        slope = tl.load(slopes_ptr + b * stride_ab + head * stride_ah, mask=row_ok, other=0.0) * LOG2E_C
    # the keys any row of this tile may see, split s's share of them (whole BLOCK_N tiles)
    last = tl.minimum(first + tokens_per_tile, seq_q) - 1
    lo = (tl.maximum(first - left, 0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(seq_k, last + right + 1)
    per = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
    start = lo + split * per
    stop = tl.minimum(hi, start + per)
    k_head = k_ptr + b * stride_kb + kvh * stride_kh
    v_head = v_ptr + b * stride_vb + kvh * stride_vh
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DV_PAD], tl.float32)
    pos = tok + (seq_k - seq_q)  # ALiBi: query i sits at key position i + Sk - Sq (bottom-right)
    if INTERPRET:
        for t in range(0, MAX_TILES):
            j0 = start + t * BLOCK_N
            if j0 < stop:
                m_i, l_i, acc = _tile(
                    q,
                    k_head,
                    v_head,
                    j0,
                    stop,
                    tok,
                    pos,
                    slope,
                    left,
                    right,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    softcap,
                    stride_ks,
                    stride_vs,
                    HEAD_DIM,
                    HEAD_DIM_V,
                    D_PAD,
                    DV_PAD,
                    BLOCK_N,
                    ALIBI,
                    SOFTCAP,
                    MASK,
                    UPCAST,
                )
    else:
        for j0 in range(start, stop, BLOCK_N):
            m_i, l_i, acc = _tile(
                q,
                k_head,
                v_head,
                j0,
                stop,
                tok,
                pos,
                slope,
                left,
                right,
                m_i,
                l_i,
                acc,
                qk_scale,
                softcap,
                stride_ks,
                stride_vs,
                HEAD_DIM,
                HEAD_DIM_V,
                D_PAD,
                DV_PAD,
                BLOCK_N,
                ALIBI,
                SOFTCAP,
                MASK,
                UPCAST,
            )
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    dv = tl.arange(0, DV_PAD)
    mask = row_ok[:, None] & (dv < HEAD_DIM_V)[None, :]
    if SPLIT:
        row = ((b * num_heads + head) * seq_q + tok).to(tl.int64) * num_splits + split
        tl.store(ws_ptr + row[:, None] * HEAD_DIM_V + dv[None, :], out, mask=mask)
        tl.store(
            ws_lse_ptr + row,
            tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")),
            mask=row_ok,
        )
    else:
        tl.store(
            o_ptr
            + b * stride_ob
            + head.to(tl.int64)[:, None] * stride_oh
            + tok.to(tl.int64)[:, None] * stride_os
            + dv[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _tile(
    q,
    k_head,
    v_head,
    j0,
    stop,
    tok,
    pos,
    slope,
    left,
    right,
    m_i,
    l_i,
    acc,
    qk_scale,
    softcap,
    stride_ks,
    stride_vs,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax step over keys ``[j0, j0 + BLOCK_N)`` clipped to ``stop``; scores in base 2
    (``log2(e)`` folded into the scale, the soft-cap and the slopes). A row with no key seen yet keeps m =
    -inf and weight 0 (no NaN: the running maximum is taken as 0 while it is -inf)."""
    j = j0 + tl.arange(0, BLOCK_N)
    j_ok = j < stop
    d = tl.arange(0, D_PAD)
    k = tl.load(
        k_head + j.to(tl.int64)[:, None] * stride_ks + d[None, :],
        mask=j_ok[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, BLOCK_N] float32
    if SOFTCAP:  # softcap * tanh(x), tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without overflow
        s = softcap * (1.0 - 2.0 / (tl.exp2((2.0 * LOG2E_C) * (s * qk_scale)) + 1.0))
    else:
        s = s * qk_scale
    if ALIBI:
        s = s - slope[:, None] * tl.abs(pos[:, None] - j[None, :]).to(tl.float32)
    ok = j_ok[None, :]
    if MASK:
        ok = ok & (j[None, :] >= tok[:, None] - left) & (j[None, :] <= tok[:, None] + right)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    dv = tl.arange(0, DV_PAD)
    if HEAD_DIM_V < DV_PAD:
        # Dv padded: columns >= Dv re-read column Dv - 1 (in bounds; their accumulator columns are never
        # stored) instead of a mask along Dv. Triton 3.6's sm_90 code for a Dv-masked V tile feeding the
        # P @ V wgmma gave wrong values for every column, or an illegal address, e.g. D 72 / Dv 8 or 24 with
        # 64 x 64 tiles on 4 warps (H200, seed 15036 of the GPU sweep). Costs vectorized V loads there.
        dv = tl.minimum(dv, HEAD_DIM_V - 1)
    v = tl.load(v_head + j.to(tl.int64)[:, None] * stride_vs + dv[None, :], mask=j_ok[:, None], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["seq_q", "num_heads", "num_splits"])
def attention_merge(
    ws_ptr,
    ws_lse_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    seq_q,
    num_heads,
    num_splits,
    HEAD_DIM_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
):
    """Grid ``(B * Hq * Sq,)``: output row ``(b Hq + h) Sq + i`` is the merge of its ``num_splits`` partials
    (weights ``2^(lse_s - max lse)``, empty splits weigh 0, a row no split saw stores 0), in the output's
    dtype."""
    row = tl.program_id(0).to(tl.int64)
    i = row % seq_q
    bh = row // seq_q
    o_row = (bh // num_heads) * stride_ob + (bh % num_heads) * stride_oh + i * stride_os
    merge_row(
        ws_ptr,
        ws_lse_ptr,
        o_ptr,
        ws_lse_ptr,
        row * num_splits,
        row * num_splits * HEAD_DIM_V,
        o_row,
        0,
        HEAD_DIM_V,
        num_splits,
        HEAD_DIM_V,
        DV_PAD,
        S_PAD,
        False,
    )
