"""The ``@triton.jit`` code of ``triton.qkv_rope_cache`` (private; imported only after ``import triton``
succeeded): a decode layer's whole QKV block in one kernel, the input RMSNorm (with the residual add), the packed QKV
projection, Qwen3's per-head q / k RMSNorm, RoPE, and the new K/V written into the paged cache.

Why one kernel: at batch 1 every dependent kernel of a CUDA graph costs ~1.5 µs even when it does almost nothing (the
H200 timelines of ``benchmarks/results/engine/h200/2026-11-28b/``), and the RoPE kernel between the projection and the
attention was one of seven a layer. The per-head norm and the rotation need a head's whole output row, which the
projection kernel's narrow programs (``triton.gemv``: 4-8 output columns each) never hold, so here a program owns
one whole head: grid ``(Hq + 2 * Hkv,)``, program h computing the ``D`` outputs of head h (q heads first, then k,
then v) for every row of x.

A program walks K in ``BK`` steps (Triton pipelines the weight loads through shared memory, ``num_stages``), each
step one ``tl.dot`` of the normalized x tile ``[BM, BK]`` (rows padded to 16) with the head's two weight halves
``[D/2, BK]``: the rotation pairs (i, i + D/2) (``INTERLEAVED``: (2i, 2i + 1)) land in two accumulators, so the
epilogue rotates without moving values between lanes. Then, as the unfused ops round: the projection to the model
dtype, for q / k heads the per-head RMSNorm in float32 and the rotation with one rounding
(``triton.qk_norm_rope``'s formula term by term), q to ``QO``, k and v to the cache at the row's slot (-1: skipped).

x's normalization needs the whole row's mean square before the first step: each program walks the row once for it
(K values from L2), then again with the weights. With ``RESIDUAL`` the row is ``x + residual`` rounded to the
model dtype, program 0 storing it (the new residual stream).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter


@triton.jit
def _norm_rotate(ya, yb, w_ptr, ra, rb, c_a, c_b, s_a, s_b, eps, D: tl.constexpr, QK_NORM: tl.constexpr):
    """Rows of one head as its two pair halves ``ya`` / ``yb`` ``[BM, D/2]`` float32 -> (RMSNorm over the head with
    weight ``w_ptr`` when ``QK_NORM``, then RoPE) as two halves, float32."""
    if QK_NORM:
        inv = tl.rsqrt((tl.sum(ya * ya, axis=1) + tl.sum(yb * yb, axis=1)) / D + eps)[:, None]
        ya = ya * inv * tl.load(w_ptr + ra).to(tl.float32)[None, :]
        yb = yb * inv * tl.load(w_ptr + rb).to(tl.float32)[None, :]
    return ya * c_a - yb * s_a, yb * c_b + ya * s_b


@triton.jit
def _row_tile(X, R, rm, rk, mk, stride_x, stride_r, RESIDUAL: tl.constexpr):
    """x's ``[BM, BK]`` tile (plus the residual's, rounded to x's dtype, with ``RESIDUAL``)."""
    x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=mk, other=0.0)
    if RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + rm[:, None] * stride_r + rk[None, :], mask=mk, other=0.0)
             .to(tl.float32)).to(X.dtype.element_ty)
    return x


@triton.jit
def _qkv_rope_cache(X, R, RO, NW, W, B, QO, KV, QW, KW, COS, SIN, POS, SLOTS,
                    M, stride_x, stride_r, stride_ro, stride_w, stride_qo, stride_qh, stride_cos, stride_sin,
                    c_blk, c_kv, c_tok, c_h, page, eps, qk_eps, n_q_heads, n_kv_heads,
                    K: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                    HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, QK_NORM: tl.constexpr,
                    INTERLEAVED: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    h = tl.program_id(0)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    if INTERLEAVED:  # GPT-J pairs (2i, 2i + 1)
        ra = 2 * i
        rb = 2 * i + 1
    else:  # GPT-NeoX / Llama half rotation (i, i + D/2)
        ra = i
        rb = i + HALF
    rm = tl.arange(0, BM)
    m_ok = rm < M
    wa = W + (h * D + ra)[:, None].to(tl.int64) * stride_w
    wb = W + (h * D + rb)[:, None].to(tl.int64) * stride_w
    # step metadata and the cos / sin tables before the wait: no kernel of a forward writes them (see _gdc_kernels)
    pos = tl.load(POS + rm, mask=m_ok, other=0).to(tl.int64)
    c_a = tl.load(COS + pos[:, None] * stride_cos + ra[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    c_b = tl.load(COS + pos[:, None] * stride_cos + rb[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    s_a = tl.load(SIN + pos[:, None] * stride_sin + ra[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    s_b = tl.load(SIN + pos[:, None] * stride_sin + rb[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel before reading x or writing anything
    # the row's mean square (after the residual add, rounded to the model dtype as the unfused ops round), tile by tile
    sq = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = m_ok[:, None] & (rk < K)[None, :]
        x = _row_tile(X, R, rm, rk, mk, stride_x, stride_r, RESIDUAL)
        if RESIDUAL:
            tl.store(RO + rm[:, None] * stride_ro + rk[None, :], x, mask=mk & (h == 0))
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
    rstd = tl.rsqrt(sq / K + eps)[:, None]
    acc_a = tl.zeros((BM, HALF), dtype=tl.float32)
    acc_b = tl.zeros((BM, HALF), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = m_ok[:, None] & (rk < K)[None, :]
        x = _row_tile(X, R, rm, rk, mk, stride_x, stride_r, RESIDUAL)
        nw = tl.load(NW + rk, mask=rk < K, other=0.0).to(tl.float32)
        # triton.rms_norm's rounding: the normalized row to x's dtype, then times the weight, rounded again
        xn = ((x.to(tl.float32) * rstd).to(X.dtype.element_ty).to(tl.float32) * nw[None, :]).to(X.dtype.element_ty)
        w_a = tl.load(wa + rk[None, :], mask=(rk < K)[None, :], other=0.0)
        w_b = tl.load(wb + rk[None, :], mask=(rk < K)[None, :], other=0.0)
        if UPCAST:  # the Triton interpreter's tl.dot mishandles bfloat16 (numpy has no such type)
            xn, w_a, w_b = xn.to(tl.float32), w_a.to(tl.float32), w_b.to(tl.float32)
        acc_a = tl.dot(xn, tl.trans(w_a), acc_a)
        acc_b = tl.dot(xn, tl.trans(w_b), acc_b)
    if HAS_BIAS:
        acc_a += tl.load(B + h * D + ra).to(tl.float32)[None, :]
        acc_b += tl.load(B + h * D + rb).to(tl.float32)[None, :]
    # the projection's output as the unfused path stores it (model dtype), then the head's own work
    ya = acc_a.to(X.dtype.element_ty).to(tl.float32)
    yb = acc_b.to(X.dtype.element_ty).to(tl.float32)
    slot = tl.load(SLOTS + rm, mask=m_ok, other=-1).to(tl.int64)
    c_ok = m_ok & (slot >= 0)
    row = KV + (slot // page) * c_blk + (slot % page) * c_tok  # [BM] the row's slot in the K half
    if h < n_q_heads:
        oa, ob = _norm_rotate(ya, yb, QW, ra, rb, c_a, c_b, s_a, s_b, qk_eps, D, QK_NORM)
        q_row = QO + rm[:, None] * stride_qo + h * stride_qh
        tl.store(q_row + ra[None, :], oa.to(QO.dtype.element_ty), mask=m_ok[:, None])
        tl.store(q_row + rb[None, :], ob.to(QO.dtype.element_ty), mask=m_ok[:, None])
    elif h < n_q_heads + n_kv_heads:
        oa, ob = _norm_rotate(ya, yb, KW, ra, rb, c_a, c_b, s_a, s_b, qk_eps, D, QK_NORM)
        k_row = row[:, None] + (h - n_q_heads) * c_h
        tl.store(k_row + ra[None, :], oa.to(KV.dtype.element_ty), mask=c_ok[:, None])
        tl.store(k_row + rb[None, :], ob.to(KV.dtype.element_ty), mask=c_ok[:, None])
    else:
        v_row = row[:, None] + c_kv + (h - n_q_heads - n_kv_heads) * c_h
        tl.store(v_row + ra[None, :], ya.to(KV.dtype.element_ty), mask=c_ok[:, None])
        tl.store(v_row + rb[None, :], yb.to(KV.dtype.element_ty), mask=c_ok[:, None])
