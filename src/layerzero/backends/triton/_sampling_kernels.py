"""Triton inverse-CDF token draw for top-k / top-p / plain sampling. Imported only after ``import triton``
succeeded.

One program per row. The row holds ``n_cols`` logits, either the whole vocabulary in token order or a
prefix of the logits sorted descending (``torch.topk`` / ``torch.sort`` output, with ``IDX`` mapping a
position to its token id). All loops stream the row in ``BLOCK`` tiles:

1. online softmax statistics at temperature ``1 / inv_temp``: running max ``m`` of the raw logits and
   ``total = sum(exp((logit - m) * inv_temp))`` (float32, rescaled when the max grows: Milakov & Gimelshein
   2018). Scaling the difference, never the logit itself, keeps every exponent <= 0: a tiny temperature sends
   the non-maximal terms to ``exp(-inf) = 0`` instead of overflowing ``logit * inv_temp`` to ``inf`` (NaN).
   ``inv_temp`` must be finite (``lz.sample_*`` treats temperatures below float32's smallest normal as
   greedy);
2. ``TOP_P`` only: the kept prefix is every position whose mass before it is ``< p * total`` (at least one);
   its mass ``kept`` is summed;
3. the draw: ``target = u * kept`` (``u`` in [0, 1) from the caller's generator) and the token is the first
   kept position whose running sum ``cum_i > target``; positions with zero probability can never be picked
   (``cum`` does not grow there). If rounding leaves no such position (``u`` near 1), the last kept position
   with non-zero probability is taken.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sample_row(
    L,
    IDX,
    U,
    OUT,
    stride_l,
    stride_idx,
    n_cols,
    inv_temp,
    top_p,
    HAS_IDX: tl.constexpr,
    TOP_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    l_row = L + row * stride_l
    cols = tl.arange(0, BLOCK)
    # 1. online max / sum of exp (while loops: the interpreter cannot take a runtime range() bound)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    start = n_cols * 0
    while start < n_cols:
        offs = start + cols
        x = tl.load(l_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        scale = tl.where(m_new == float("-inf"), 0.0, tl.exp((m - m_new) * inv_temp))
        e = tl.where(x == float("-inf"), 0.0, tl.exp((x - m_new) * inv_temp))
        total = total * scale + tl.sum(e, axis=0)
        m = m_new
        start += BLOCK
    # 2. top-p: length and mass of the kept prefix (the input is sorted descending)
    n_keep = n_cols
    kept = total
    if TOP_P:
        threshold = top_p * total
        n_keep = n_cols * 0
        kept = tl.zeros([], tl.float32)
        running = tl.zeros([], tl.float32)
        start = n_cols * 0
        while start < n_cols:
            offs = start + cols
            x = tl.load(l_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
            e = tl.where(x == float("-inf"), 0.0, tl.exp((x - m) * inv_temp))
            before = running + tl.cumsum(e, axis=0) - e
            keep = ((before < threshold) | (offs == 0)) & (offs < n_cols)
            n_keep += tl.sum(keep.to(tl.int32), axis=0)
            kept += tl.sum(tl.where(keep, e, 0.0), axis=0)
            running += tl.sum(e, axis=0)
            start += BLOCK
    # 3. inverse CDF over the kept prefix
    target = tl.load(U + row).to(tl.float32) * kept
    first = n_cols * 0 + 2147483647
    last_nonzero = n_cols * 0
    running = tl.zeros([], tl.float32)
    start = n_cols * 0
    while start < n_keep:
        offs = start + cols
        valid = offs < n_keep
        x = tl.load(l_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        e = tl.where(valid & (x != float("-inf")), tl.exp((x - m) * inv_temp), 0.0)
        cum = running + tl.cumsum(e, axis=0)
        hit = valid & (cum > target) & (e > 0.0)
        first = tl.minimum(first, tl.min(tl.where(hit, offs, 2147483647), axis=0))
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(valid & (e > 0.0), offs, 0), axis=0))
        running += tl.sum(e, axis=0)
        start += BLOCK
    pos = tl.where(first == 2147483647, last_nonzero, first)
    if HAS_IDX:
        token = tl.load(IDX + row * stride_idx + pos).to(tl.int64)
    else:
        token = pos.to(tl.int64)
    tl.store(OUT + row, token)


# ------------------------------------------------------------------------------------------------ lz.sample
# The exponential race of ``reference.sample`` in one launch (one program per row, two passes over the row):
# pass 1 finds the row max (and its first index, the greedy token); pass 2 scales ``z = (x - max) / T``,
# applies the min-p cut (``exp(z) < min_p``: ``prob / max prob`` without the softmax sum), draws counter-based
# Exp(1) noise ``E = -log((h + 0.5) / 2**32)`` from the 32-bit hash ``h`` of (seed, offset, token index)
# exactly as ``reference.sampling.counter_hash`` (uint32 arithmetic wraps where the reference masks), and
# keeps the first index of the largest ``z - log(E)``.


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _mix(h, v):
    return _lowbias32((h ^ v) + 0x9E3779B9)


@triton.jit
def _row_setup(
    T,
    MINP,
    SEEDS,
    OFFS,
    BASE,
    row,
    greedy_below,
    HAS_T: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_SEEDS: tl.constexpr,
):
    """One row's race parameters, shared by ``_race_row`` and the split kernels (so both score identically):
    ``(t, greedy, min_p, h0)``: the temperature (1 for greedy rows), whether the row is greedy, its min-p, and
    the hash state of its noise stream: its own (seed, offset) when seeded, else (the call's random base,
    row)."""
    t = 1.0
    if HAS_T:
        t = tl.load(T + row).to(tl.float32)
    greedy = t < greedy_below
    t = tl.where(greedy, 1.0, t)
    mp = 0.0
    if HAS_MINP:
        mp = tl.load(MINP + row).to(tl.float32)
    seed = tl.load(BASE)
    off = row
    if HAS_SEEDS:
        s = tl.load(SEEDS + row)
        seeded = s >= 0
        seed = tl.where(seeded, s, seed)
        off = tl.where(seeded, tl.load(OFFS + row), off)
    h0 = _mix(tl.zeros([], tl.uint32), (seed & 0xFFFFFFFF).to(tl.uint32))
    h0 = _mix(h0, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h0 = _mix(h0, (off & 0xFFFFFFFF).to(tl.uint32))
    h0 = _mix(h0, ((off >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return t, greedy, mp, h0


@triton.jit
def _max_step(x_row, offs, valid, m, arg):
    """One tile of the max pass: folds the tile's maximum and its first column into ``(m, arg)`` (earlier
    columns win ties)."""
    x = tl.load(x_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    bm = tl.max(x, axis=0)
    bi = tl.min(tl.where((x == bm) & valid, offs, 2147483647), axis=0)
    return tl.maximum(m, bm), tl.where(bm > m, bi, arg)


@triton.jit
def _race_step(x_row, offs, valid, m, t, mp, h0, tiny, best, best_i, HAS_MINP: tl.constexpr):
    """One tile of the race: ``z = (x - m) / t``, the min-p cut, the Exp(1) noise hashed from
    ``(h0, column)``, the score ``z - log E``; folds the tile's first maximum into ``(best, best_i)`` (earlier
    columns win ties)."""
    x = tl.load(x_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    z = (x - m) / t
    if HAS_MINP:
        z = tl.where(tl.exp(z) < mp, float("-inf"), z)
    bm, bi = _race_tile(z, offs, valid, h0, tiny)
    return tl.maximum(best, bm), tl.where(bm > best, bi, best_i)


@triton.jit
def _race_tile(z, offs, valid, h0, tiny):
    """The exponential race over one tile: the Exp(1) noise ``E`` hashed from ``(h0, column)``, the score
    ``z - log E`` of the ``valid`` columns; returns the tile's best score and its first column (shared by
    the race and the rejection kernels, so both draw the same noise)."""
    h = _mix(h0, offs.to(tl.uint32))
    e = (-tl.log((h.to(tl.float64) + 0.5) * 2.3283064365386963e-10)).to(tl.float32)
    score = tl.where(valid, z - tl.log(tl.maximum(e, tiny)), float("-inf"))
    bm = tl.max(score, axis=0)
    bi = tl.min(tl.where((score == bm) & valid, offs, 2147483647), axis=0)
    return bm, bi


@triton.jit
def _race_row(
    X,
    T,
    MINP,
    SEEDS,
    OFFS,
    BASE,
    OUT,
    stride_x,
    n_cols,
    greedy_below,
    tiny,
    HAS_T: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_SEEDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    # pass 1: the row max and the first index holding it
    m = tl.full([], float("-inf"), tl.float32)
    arg = n_cols * 0
    start = n_cols * 0
    while start < n_cols:
        offs = start + cols
        m, arg = _max_step(x_row, offs, offs < n_cols, m, arg)
        start += BLOCK
    t, greedy, mp, h0 = _row_setup(T, MINP, SEEDS, OFFS, BASE, row, greedy_below, HAS_T, HAS_MINP, HAS_SEEDS)
    # pass 2: the race
    best = tl.full([], float("-inf"), tl.float32)
    best_i = n_cols * 0
    start = n_cols * 0
    while start < n_cols:
        offs = start + cols
        best, best_i = _race_step(x_row, offs, offs < n_cols, m, t, mp, h0, tiny, best, best_i, HAS_MINP)
        start += BLOCK
    tl.store(OUT + row, tl.where(greedy, arg, best_i).to(tl.int64))
