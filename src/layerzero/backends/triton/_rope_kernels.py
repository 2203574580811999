"""Triton RoPE forward (half rotation and interleaved pairs, partial rotary). Imported only after
``import triton`` succeeded.

Grid: ``(B * S, cdiv(Hq, BLOCK_H) + cdiv(Hkv, BLOCK_H))``: a program owns one token (b, s) and a block of
``BLOCK_H`` heads of q (first grid columns) or of k (the rest), loads that token's cos/sin row once and
rotates a ``[BLOCK_H, R/2]`` tile of pairs; dims >= R are copied. Every tensor is addressed through its
strides in logical (b, h, s, d) order, so BHSD, BSHD and strided views are read in place (no copies).
Math in float32: ``out_a = x_a * cos_a - x_b * sin_a``, ``out_b = x_b * cos_b + x_a * sin_b`` where (a, b) is
``(i, i + R/2)`` for the half rotation (GPT-NeoX/Llama) and ``(2i, 2i + 1)`` for interleaved pairs (GPT-J),
exactly the reference's ``x * cos + rotate(x) * sin`` term by term; one rounding to the output dtype.

``NORM`` (``lz.qk_norm_rope``): each head is first RMS-normalized over its D dims in float32,
``x * rsqrt(sum(x^2) / D + eps) * w`` (the head's rotary pairs and its pass-through dims are all loaded by the
same program, so the sum is complete), and the normalized values go into the rotation without a rounding in
between.

``CACHE`` (``lz.qk_norm_rope_cache``): the k programs also store their rotated heads (the same rounded values
as the output) and the token's v heads into a paged KV cache at the token's slot (vLLM's slot mapping; -1
skips), as ``lz.reshape_and_cache`` would: one launch where a decode layer ran two. q/k/v are token-major
there (B = 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter


@triton.jit
def _rotate_heads(
    X,
    OUT,
    W,
    sx_b,
    sx_h,
    sx_s,
    sx_d,
    so_b,
    so_h,
    so_s,
    so_d,
    b,
    s,
    h0,
    n_heads,
    c_a,
    c_b,
    s_a,
    s_b,
    off_a,
    off_b,
    half,
    n_rot,
    n_dim,
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    NORM: tl.constexpr,
    C=None,
    sc_h=0,
    sc_d=0,
    c_ok=False,
    CACHE: tl.constexpr = False,
):
    heads = h0 + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    imask = tl.arange(0, BLOCK_HALF) < half
    pmask = hmask[:, None] & imask[None, :]
    x_base = X + b * sx_b + s * sx_s + heads[:, None].to(tl.int64) * sx_h
    o_base = OUT + b * so_b + s * so_s + heads[:, None].to(tl.int64) * so_h
    xa = tl.load(x_base + off_a[None, :] * sx_d, mask=pmask, other=0.0).to(tl.float32)
    xb = tl.load(x_base + off_b[None, :] * sx_d, mask=pmask, other=0.0).to(tl.float32)
    if BLOCK_PASS > 0:  # partial rotary: dims R..D-1 are not rotated
        dp = n_rot + tl.arange(0, BLOCK_PASS)
        mp = hmask[:, None] & (dp < n_dim)[None, :]
        xp = tl.load(x_base + dp[None, :] * sx_d, mask=mp, other=0.0).to(tl.float32)
    if NORM:  # RMSNorm over the head's n_dim dims (masked lanes load 0), weight [D] shared by the heads
        sq = tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)
        if BLOCK_PASS > 0:
            sq += tl.sum(xp * xp, axis=1)
        inv = tl.rsqrt(sq / n_dim + eps)[:, None]
        xa = xa * inv * tl.load(W + off_a, mask=imask, other=0.0).to(tl.float32)[None, :]
        xb = xb * inv * tl.load(W + off_b, mask=imask, other=0.0).to(tl.float32)[None, :]
        if BLOCK_PASS > 0:
            xp = xp * inv * tl.load(W + dp, mask=dp < n_dim, other=0.0).to(tl.float32)[None, :]
    oa = xa * c_a[None, :] - xb * s_a[None, :]
    ob = xb * c_b[None, :] + xa * s_b[None, :]
    tl.store(o_base + off_a[None, :] * so_d, oa.to(OUT.dtype.element_ty), mask=pmask)
    tl.store(o_base + off_b[None, :] * so_d, ob.to(OUT.dtype.element_ty), mask=pmask)
    if BLOCK_PASS > 0:
        tl.store(o_base + dp[None, :] * so_d, xp.to(OUT.dtype.element_ty), mask=mp)
    if CACHE:  # the same rounded values into the KV cache's K half at this token's slot (C: the slot's base)
        c_base = C + heads[:, None].to(tl.int64) * sc_h
        tl.store(c_base + off_a[None, :] * sc_d, oa.to(C.dtype.element_ty), mask=pmask & c_ok)
        tl.store(c_base + off_b[None, :] * sc_d, ob.to(C.dtype.element_ty), mask=pmask & c_ok)
        if BLOCK_PASS > 0:
            tl.store(c_base + dp[None, :] * sc_d, xp.to(C.dtype.element_ty), mask=mp & c_ok)


@triton.jit
def _rope_fwd(
    Q,
    K,
    QO,
    KO,
    COS,
    SIN,
    POS,
    QW,
    KW,
    sq_b,
    sq_h,
    sq_s,
    sq_d,
    sk_b,
    sk_h,
    sk_s,
    sk_d,
    sqo_b,
    sqo_h,
    sqo_s,
    sqo_d,
    sko_b,
    sko_h,
    sko_s,
    sko_d,
    sc_b,
    sc_s,
    sc_r,
    ss_b,
    ss_s,
    ss_r,
    sp_b,
    sp_s,
    seq_len,
    n_heads_q,
    n_heads_k,
    n_rot,
    n_dim,
    eps,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    NORM: tl.constexpr = False,
    PDL: tl.constexpr = False,
    V=None,
    KV=None,
    SLOTS=None,
    sv_s=0,
    sv_h=0,
    sv_d=0,
    c_blk=0,
    c_kv=0,
    c_tok=0,
    c_h=0,
    c_d=0,
    page=1,
    CACHE: tl.constexpr = False,
    BLOCK_D: tl.constexpr = 1,
):
    tok = tl.program_id(0).to(tl.int64)
    hblk = tl.program_id(1)
    b = tok // seq_len
    s = tok % seq_len
    if HAS_POS:  # table [max_pos, R] indexed by position_ids [B or 1, S] (sp_b = 0 broadcasts one row)
        pos = tl.load(POS + b * sp_b + s * sp_s).to(tl.int64)
        c_row = COS + pos * sc_s
        s_row = SIN + pos * ss_s
    else:  # gathered [B or 1, S, R] (sc_b = 0 broadcasts), or a table read at positions 0..S-1 (sc_b = 0)
        c_row = COS + b * sc_b + s * sc_s
        s_row = SIN + b * ss_b + s * ss_s
    half = n_rot // 2
    i = tl.arange(0, BLOCK_HALF)
    imask = i < half
    if INTERLEAVED:
        off_a = 2 * i
        off_b = 2 * i + 1
    else:
        off_a = i
        off_b = i + half
    c_a = tl.load(c_row + off_a * sc_r, mask=imask, other=0.0).to(tl.float32)
    c_b = tl.load(c_row + off_b * sc_r, mask=imask, other=0.0).to(tl.float32)
    s_a = tl.load(s_row + off_a * ss_r, mask=imask, other=0.0).to(tl.float32)
    s_b = tl.load(s_row + off_b * ss_r, mask=imask, other=0.0).to(tl.float32)
    # the positions and the cos / sin rows above are read before the PDL wait: step metadata and tables that
    # no kernel of ours writes (see _gdc_kernels), so they arrive while the kernel before (the QKV projection)
    # finishes
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel before reading q / k / v or writing anything
    q_blocks = tl.cdiv(n_heads_q, BLOCK_H)
    if hblk < q_blocks:
        _rotate_heads(
            Q,
            QO,
            QW,
            sq_b,
            sq_h,
            sq_s,
            sq_d,
            sqo_b,
            sqo_h,
            sqo_s,
            sqo_d,
            b,
            s,
            hblk * BLOCK_H,
            n_heads_q,
            c_a,
            c_b,
            s_a,
            s_b,
            off_a,
            off_b,
            half,
            n_rot,
            n_dim,
            eps,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            NORM,
        )
    elif (
        CACHE
    ):  # lz.qk_norm_rope_cache: k (rotated) and v also go to the paged cache at the token's slot (-1: skip)
        slot = tl.load(SLOTS + tok).to(tl.int64)
        c_ok = slot >= 0
        c_k = KV + (slot // page) * c_blk + (slot % page) * c_tok
        h0 = (hblk - q_blocks) * BLOCK_H
        _rotate_heads(
            K,
            KO,
            KW,
            sk_b,
            sk_h,
            sk_s,
            sk_d,
            sko_b,
            sko_h,
            sko_s,
            sko_d,
            b,
            s,
            h0,
            n_heads_k,
            c_a,
            c_b,
            s_a,
            s_b,
            off_a,
            off_b,
            half,
            n_rot,
            n_dim,
            eps,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            NORM,
            c_k,
            c_h,
            c_d,
            c_ok,
            CACHE,
        )
        heads = h0 + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        vm = (heads < n_heads_k)[:, None] & (dims < n_dim)[None, :]
        vals = tl.load(
            V + tok * sv_s + heads[:, None].to(tl.int64) * sv_h + dims[None, :] * sv_d, mask=vm, other=0.0
        )
        tl.store(
            c_k + c_kv + heads[:, None].to(tl.int64) * c_h + dims[None, :] * c_d,
            vals.to(KV.dtype.element_ty),
            mask=vm & c_ok,
        )
    else:
        _rotate_heads(
            K,
            KO,
            KW,
            sk_b,
            sk_h,
            sk_s,
            sk_d,
            sko_b,
            sko_h,
            sko_s,
            sko_d,
            b,
            s,
            (hblk - q_blocks) * BLOCK_H,
            n_heads_k,
            c_a,
            c_b,
            s_a,
            s_b,
            off_a,
            off_b,
            half,
            n_rot,
            n_dim,
            eps,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            NORM,
        )
