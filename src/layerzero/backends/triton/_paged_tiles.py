"""The ``@triton.jit`` helpers of the paged decode kernels (private; imported by ``_paged_kernels``,
``_rope_paged_kernels`` and ``_cascade_tiles`` only after ``import triton`` succeeded): the K / V gathers
through a block table (:func:`kv_at`, :func:`kv_tile`), one online-softmax step over a tile
(:func:`_attend_kv`, :func:`_attend_tile`: the tile loop), and ``ONE_PASS``'s gathers of a split's every tile
at once (:func:`pass_ids`, :func:`pass_kv`, :func:`pass_newest`, :func:`attend_pass`). Split from
``_paged_kernels.py`` (the split kernel), which imports them: a ``@triton.jit`` function finds the functions
it calls through its module's globals. No kernel here: nothing is launched from this module."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_at(
    kv_head,
    blk,
    pos,
    p_ok,
    stride_blk,
    stride_kv,
    stride_pos,
    page,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """K and V ``[len(pos), D_PAD]`` at KV positions ``pos`` whose block ids ``blk`` are read already
    (position t at block ``blk``, offset ``t % page``); positions not in ``p_ok`` load nothing (0). Returns
    ``(k, v)``."""
    d = tl.arange(0, D_PAD)
    base = kv_head + blk.to(tl.int64) * stride_blk + (pos % page).to(tl.int64) * stride_pos
    mask = p_ok[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(base[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(base[:, None] + stride_kv + d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def kv_tile(
    kv_head,
    bt_row,
    t0,
    stop,
    stride_blk,
    stride_kv,
    stride_pos,
    page,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    skip=-1,
):
    """K and V ``[BLOCK_N, D_PAD]`` of KV positions ``[t0, t0 + BLOCK_N)`` of one sequence and KV head,
    gathered through its block-table row (:func:`kv_at`); positions ``>= stop`` (and their block ids) and
    position ``skip`` load nothing (0). Returns ``(positions, mask of the positions loaded, k, v)``."""
    pos = t0 + tl.arange(0, BLOCK_N)
    p_ok = (pos < stop) & (pos != skip)
    blk = tl.load(bt_row + pos // page, mask=p_ok, other=0)
    k, v = kv_at(kv_head, blk, pos, p_ok, stride_blk, stride_kv, stride_pos, page, HEAD_DIM, D_PAD)
    return pos, p_ok, k, v


@triton.jit
def _attend_kv(q, k, v, p_ok, m_i, l_i, acc, qk_scale, ks, vs, UPCAST: tl.constexpr, QUANT: tl.constexpr):
    """One online-softmax step over a K / V tile ``[BLOCK_N, D_PAD]`` whose positions ``p_ok`` are valid:
    returns the updated ``(m, l, acc)``; a tile with no valid position changes nothing (the running max stays
    ``-inf``: the exponentials are taken against 0 there, so no ``-inf - -inf``). ``UPCAST``: both dots in
    float32 (the interpreter's ``tl.dot`` misreads bfloat16 operands). ``QUANT``: the cache holds
    float8_e4m3fn / int8 codes, read as ``code * scale`` in float32 (``core.kv_quant.dequantize_kv``; the
    caller sets ``UPCAST`` too, so both dots run in float32)."""
    if QUANT:
        k = k.to(tl.float32) * ks
        v = v.to(tl.float32) * vs
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [GROUP_PAD, BLOCK_N], base-2 logits
    scores = tl.where(p_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(scores - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q,
    kv_head,
    bt_row,
    t0,
    stop,
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
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
    skip=-1,
):
    """:func:`_attend_kv` over KV positions ``[t0, t0 + BLOCK_N)`` clipped to ``stop``, gathered through the
    block table (:func:`kv_tile`: positions ``>= stop`` and position ``skip`` load nothing; a tile left with
    no position changes nothing)."""
    _, p_ok, k, v = kv_tile(
        kv_head, bt_row, t0, stop, stride_blk, stride_kv, stride_pos, page, HEAD_DIM, D_PAD, BLOCK_N, skip
    )
    return _attend_kv(q, k, v, p_ok, m_i, l_i, acc, qk_scale, ks, vs, UPCAST, QUANT)


@triton.jit
def _ids(bt_row, t0, table_len, page, BLOCK_N: tl.constexpr):
    """``(positions [t0, t0 + BLOCK_N), their block
    ids)``: ids read below ``table_len`` (the block table's width: no wait for ``seq_len``), the rest 0."""
    pos = t0 + tl.arange(0, BLOCK_N)
    return pos, tl.load(bt_row + pos // page, mask=pos < table_len, other=0)


@triton.jit
def pass_ids(bt_row, t0, step, table_len, page, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """``ONE_PASS``'s first loads: positions and block ids of the ``CHUNKS`` (1, 2 or 4) ``BLOCK_N``-position
    tiles ``t0, t0 + step, ...`` of one split (ids below ``table_len``: no wait for ``seq_len``). Returns four
    ``(positions, ids)``; past ``CHUNKS`` they repeat the first (:func:`pass_kv` reads only ``CHUNKS`` of
    them)."""
    p0, b0 = _ids(bt_row, t0, table_len, page, BLOCK_N)
    p1, b1, p2, b2, p3, b3 = p0, b0, p0, b0, p0, b0
    if CHUNKS > 1:
        p1, b1 = _ids(bt_row, t0 + step, table_len, page, BLOCK_N)
    if CHUNKS > 2:
        p2, b2 = _ids(bt_row, t0 + 2 * step, table_len, page, BLOCK_N)
        p3, b3 = _ids(bt_row, t0 + 3 * step, table_len, page, BLOCK_N)
    return p0, b0, p1, b1, p2, b2, p3, b3


@triton.jit
def pass_kv(
    kv_head,
    p0,
    b0,
    p1,
    b1,
    p2,
    b2,
    p3,
    b3,
    stop,
    skip,
    stride_blk,
    stride_kv,
    stride_pos,
    page,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """``ONE_PASS``'s K / V gathers of :func:`pass_ids`' tiles (positions below ``stop``, but ``skip``), all
    issued before any is used. Returns ``(mask, k, v)`` of four tiles; past ``CHUNKS`` they repeat the
    first."""
    c0 = (p0 < stop) & (p0 != skip)
    k0, v0 = kv_at(kv_head, b0, p0, c0, stride_blk, stride_kv, stride_pos, page, HEAD_DIM, D_PAD)
    c1, k1, v1, c2, k2, v2, c3, k3, v3 = c0, k0, v0, c0, k0, v0, c0, k0, v0
    if CHUNKS > 1:
        c1 = (p1 < stop) & (p1 != skip)
        k1, v1 = kv_at(kv_head, b1, p1, c1, stride_blk, stride_kv, stride_pos, page, HEAD_DIM, D_PAD)
    if CHUNKS > 2:
        c2 = (p2 < stop) & (p2 != skip)
        k2, v2 = kv_at(kv_head, b2, p2, c2, stride_blk, stride_kv, stride_pos, page, HEAD_DIM, D_PAD)
        c3 = (p3 < stop) & (p3 != skip)
        k3, v3 = kv_at(kv_head, b3, p3, c3, stride_blk, stride_kv, stride_pos, page, HEAD_DIM, D_PAD)
    return c0, k0, v0, c1, k1, v1, c2, k2, v2, c3, k3, v3


@triton.jit
def _put_row(p, c, k, v, newest, kn, vn):
    """One :func:`pass_kv` tile gathered without position ``newest``: its row there becomes ``kn`` / ``vn``
    (when the tile holds that position). Returns ``(mask, k, v)``."""
    is_new = p == newest
    return c | is_new, tl.where(is_new[:, None], kn[None, :], k), tl.where(is_new[:, None], vn[None, :], v)


@triton.jit
def pass_newest(
    kv_head,
    blk,
    newest,
    here,
    p0,
    p1,
    p2,
    p3,
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
    stride_blk,
    stride_kv,
    stride_pos,
    page,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """``EARLY``'s last K / V loads: position ``newest`` (block id ``blk``, the one the kernel just before
    writes) read now, by the split that holds it (``here``), as one K and one V row, and put into
    :func:`pass_kv`'s tiles, which were gathered before the PDL wait without it. Returns ``pass_kv``'s
    ``(mask, k, v)`` x 4."""
    d = tl.arange(0, D_PAD)
    row = kv_head + blk.to(tl.int64) * stride_blk + (newest % page).to(tl.int64) * stride_pos + d
    ok = (d < HEAD_DIM) & here
    kn = tl.load(row, mask=ok, other=0.0)
    vn = tl.load(row + stride_kv, mask=ok, other=0.0)
    c0, k0, v0 = _put_row(p0, c0, k0, v0, newest, kn, vn)
    if CHUNKS > 1:
        c1, k1, v1 = _put_row(p1, c1, k1, v1, newest, kn, vn)
    if CHUNKS > 2:
        c2, k2, v2 = _put_row(p2, c2, k2, v2, newest, kn, vn)
        c3, k3, v3 = _put_row(p3, c3, k3, v3, newest, kn, vn)
    return c0, k0, v0, c1, k1, v1, c2, k2, v2, c3, k3, v3


@triton.jit
def attend_pass(
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
    stop,
    m_i,
    l_i,
    acc,
    qk_scale,
    ks,
    vs,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """:func:`_attend_kv` over :func:`pass_kv`'s tiles that start below ``stop`` (the rest hold no
    position)."""
    if t0 < stop:
        m_i, l_i, acc = _attend_kv(q, k0, v0, c0, m_i, l_i, acc, qk_scale, ks, vs, UPCAST, QUANT)
    if CHUNKS > 1:
        if t0 + step < stop:
            m_i, l_i, acc = _attend_kv(q, k1, v1, c1, m_i, l_i, acc, qk_scale, ks, vs, UPCAST, QUANT)
    if CHUNKS > 2:
        if t0 + 2 * step < stop:
            m_i, l_i, acc = _attend_kv(q, k2, v2, c2, m_i, l_i, acc, qk_scale, ks, vs, UPCAST, QUANT)
        if t0 + 3 * step < stop:
            m_i, l_i, acc = _attend_kv(q, k3, v3, c3, m_i, l_i, acc, qk_scale, ks, vs, UPCAST, QUANT)
    return m_i, l_i, acc
