"""The ``@triton.jit`` code of ``triton.rope_paged_decode`` (private; imported by :mod:`.rope_paged` only
after ``import triton`` succeeded): ``lz.rope_paged_attention`` for decode (one new token per sequence) as the
split kernel of ``triton.paged_decode`` (:mod:`._paged_kernels`, FlashDecoding) with the work of the two
kernels before it done in its own programs, as TensorRT-LLM's masked multi-head attention applies RoPE and
appends the KV itself.

Program (b, h, s) of grid ``(B, Hkv, S)`` loads the new token's query heads of KV head h's GQA group, its k
and v head, and the cos / sin row of its position; RMS-normalizes q and k per head over D in float32
(``NORM``, Qwen3's q_norm / k_norm), rotates them (half rotation or ``INTERLEAVED`` pairs over all D dims:
``out[d] = x[d] cos[d] + sign(d) x[partner(d)] sin[d]``, the ``lz.rope`` kernel's formula term by term) and
rounds both to the input dtype, as ``lz.qk_norm_rope`` returns them. Every split then runs
``paged_decode_split``'s online softmax over its interleaved tiles of the *cached* positions, the new token's
position (``seq_lens[b] - 1``) masked out like the positions past the length, and split 0 adds the new token
as one more online-softmax step from registers: no split reads what split 0 writes, and nothing runs between
the projection and the attention. Split 0 stores k and v at the token's slot last (-1: not stored; a store
before the loop would keep the loop's loads from being issued while q and k are computed). The partials go to
the same workspace and merge kernel (``paged_decode_merge``) as ``triton.paged_decode``'s, so the result is
``lz.qk_norm_rope`` -> ``lz.reshape_and_cache`` -> ``triton.paged_decode``'s up to rounding (the new token is
summed last, the norm's operations are ordered differently).

Every program recomputes its group's q and its head's k (two to sixteen ``[D]`` rows: far less than one KV
tile). Nothing here reads a device value on the host: a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter
from ._paged_tiles import _attend_tile, attend_pass, pass_ids, pass_kv


@triton.jit
def _norm_rope(
    x, xp, w_ptr, d, partner, d_ok, sign, cos, sin, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr
):
    """Rows ``x`` ``[R, D_PAD]`` (float32, masked dims 0) and their rotation partners ``xp`` -> per-row
    RMSNorm over ``HEAD_DIM`` (``NORM``, weight at ``w_ptr``) then RoPE, float32."""
    if NORM:
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = x * inv * tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        xp = xp * inv * tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    return x * cos[None, :] + sign[None, :] * xp * sin[None, :]


@triton.jit(
    do_not_specialize=["stride_bt", "split_len", "page", "group", "num_splits", "table_len", "stride_lb"]
)
def rope_paged_decode_split(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    kv_ptr,
    bt_ptr,
    lens_ptr,
    ws_out_ptr,
    ws_lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    eps,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_blk,
    stride_kv,
    stride_pos,
    stride_head,
    stride_bt,
    split_len,
    page,
    group,
    num_splits,
    table_len,
    stride_wb,
    stride_wh,
    stride_ws,
    stride_lb,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,
    NORM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr = False,
    CHUNKS: tl.constexpr = 1,
    ONE_PASS: tl.constexpr = False,
):
    """See the module docstring. Strides in elements (last dims unit-stride); the workspace and ``DIRECT`` as
    ``paged_decode_split``'s (no lse output, no fused merge, unquantized cache); ``ONE_PASS`` / ``CHUNKS`` as
    there (the split's cached tiles gathered first, before q and k are normalized and rotated)."""
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel (the QKV projection) before any memory access
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < group
    d_ok = d < HEAD_DIM
    half = HEAD_DIM // 2
    if INTERLEAVED:  # GPT-J pairs (2i, 2i + 1)
        partner = d ^ 1
        first = (d % 2) == 0
    else:  # GPT-NeoX / Llama half rotation (i, i + D/2)
        first = d < half
        partner = tl.where(first, d + half, d - half)
    sign = tl.where(first, -1.0, 1.0)
    heads = h * group + g
    qm = g_ok[:, None] & d_ok[None, :]
    kv_head = kv_ptr + h * stride_head
    bt_row = bt_ptr + b * stride_bt
    t0 = s * BLOCK_N
    step = num_splits * BLOCK_N
    # every load that needs no other first, in one batch (one memory round trip), then the dependent ones
    position = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    qx = tl.load(q_row + d[None, :], mask=qm, other=0.0).to(tl.float32)
    qp = tl.load(q_row + partner[None, :], mask=qm, other=0.0).to(tl.float32)
    k_row = k_ptr + b * stride_kb + h * stride_kh
    kx = tl.load(k_row + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    kp = tl.load(k_row + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    v_new = tl.load(v_ptr + b * stride_vb + h * stride_vh + d, mask=d_ok, other=0.0).to(
        kv_ptr.dtype.element_ty
    )
    if ONE_PASS:  # the split's cached tiles (block ids first: they wait for nothing)
        p0, b0, p1, b1, p2, b2, p3, b3 = pass_ids(bt_row, t0, step, table_len, page, BLOCK_N, CHUNKS)
    cos = tl.load(cos_ptr + position * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    new_pos = tl.where(
        slot >= 0, seq_len - 1, -1
    )  # a skipped token (-1) is read from the cache like the others
    if ONE_PASS:  # issued before the norm / RoPE math below, which would otherwise hold them back
        c0, k0, v0, c1, k1, v1, c2, k2, v2, c3, k3, v3 = pass_kv(
            kv_head,
            p0,
            b0,
            p1,
            b1,
            p2,
            b2,
            p3,
            b3,
            seq_len,
            new_pos,
            stride_blk,
            stride_kv,
            stride_pos,
            page,
            HEAD_DIM,
            D_PAD,
            CHUNKS,
        )
    q = _norm_rope(qx, qp, qw_ptr, d, partner, d_ok, sign, cos, sin, eps, HEAD_DIM, NORM).to(
        q_ptr.dtype.element_ty
    )
    k_new = tl.sum(_norm_rope(kx, kp, kw_ptr, d, partner, d_ok, sign, cos, sin, eps, HEAD_DIM, NORM), 0)
    k_new = k_new.to(kv_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    if ONE_PASS:
        m_i, l_i, acc = attend_pass(
            q,
            c0,
            k0,
            v0,
            c1,
            k1,
            v1,
            c2,
            k2,
            v2,
            c3,
            k3,
            v3,
            t0,
            step,
            seq_len,
            m_i,
            l_i,
            acc,
            qk_scale,
            1.0,
            1.0,
            UPCAST,
            False,
            CHUNKS,
        )
    elif (
        INTERPRET
    ):  # the CPU interpreter cannot loop over runtime bounds: a fixed trip count, empty tiles skipped
        for i in range(0, TILES_PER_SPLIT):
            t = t0 + i * step
            if t < seq_len:
                m_i, l_i, acc = _attend_tile(
                    q,
                    kv_head,
                    bt_row,
                    t,
                    seq_len,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    1.0,
                    1.0,
                    stride_blk,
                    stride_kv,
                    stride_pos,
                    page,
                    HEAD_DIM,
                    D_PAD,
                    BLOCK_N,
                    UPCAST,
                    False,
                    new_pos,
                )
    else:
        for t in range(t0, seq_len, step):
            m_i, l_i, acc = _attend_tile(
                q,
                kv_head,
                bt_row,
                t,
                seq_len,
                m_i,
                l_i,
                acc,
                qk_scale,
                1.0,
                1.0,
                stride_blk,
                stride_kv,
                stride_pos,
                page,
                HEAD_DIM,
                D_PAD,
                BLOCK_N,
                UPCAST,
                False,
                new_pos,
            )
    # the new token, from registers, in split 0 only (the others give it weight 0): one online-softmax step
    score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale  # [GROUP_PAD]
    score = tl.where((s == 0) & (new_pos >= 0), score, float("-inf"))
    m_new = tl.maximum(m_i, score)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(score - m_use)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
    m_i = m_new
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if DIRECT:
        o_off = b * stride_wb + heads * stride_wh
        tl.store(ws_out_ptr + o_off[:, None] + d[None, :], out.to(ws_out_ptr.dtype.element_ty), mask=qm)
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        w_off = b * stride_wb + heads * stride_wh + s * stride_ws
        tl.store(
            ws_out_ptr + w_off[:, None] + d[None, :], out, mask=qm & nonempty[:, None]
        )  # as paged_decode_split
        tl.store(ws_lse_ptr + b * stride_lb + heads * num_splits + s, lse, mask=g_ok)
    # the KV write last: a store before the loop would keep the compiler from issuing the loop's loads ahead
    # of it
    c_new = kv_head + (slot // page) * stride_blk + (slot % page) * stride_pos
    w_ok = d_ok & (slot >= 0) & (s == 0)
    tl.store(c_new + d, k_new, mask=w_ok)
    tl.store(c_new + stride_kv + d, v_new, mask=w_ok)
