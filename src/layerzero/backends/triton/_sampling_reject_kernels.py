"""``triton.sample``'s sort-free top-k / top-p kernel: pivot rejection over the exponential race, one program
per row. Imported only after ``import triton`` succeeded (lazily, on the first call with a cut).

Per row (``z = (x - max) / T``, ``e = exp z``; ranking: larger ``z`` first, equal ``z`` by lower token id,
the order of the reference's stable sort):

1. pass: the row max and its first index (the greedy token);
2. rows with top-p (``p < 1``): the mass Z the cut is relative to: the whole row's ``sum(e)``, or with top-k
   too the top-k set's -- its k-th largest value found exactly by radix select over the order-preserving
   32-bit keys of ``z`` (four 256-bin histogram passes, only for rows with both cuts), then one pass for the
   sum;
3. rounds, one pass each: the race ``argmax(z - log E)`` over the candidates -- tokens passing min-p
   (``e >= min_p``) ranked above the current pivot (at first all) -- gives token j; the same pass also tests
   the previous round's j: top-k (fewer than k tokens with a larger ``z``), top-p (the mass ranked above it
   ``< p * Z``). An accepted j is the row's token; a rejected one becomes the pivot. Rows without a cut take
   the first race's token. Tiles without a candidate left skip the noise hash (after a few rounds the
   candidates sit in a few tiles: a round is then a plain read and compare).

``E`` is the same counter-based Exp(1) noise in every round (hashed from the row's (seed, offset) or, for
unseeded rows, the call's random base and the row index, exactly as ``_sampling_kernels._race_row``): the
accepted token is then the argmax of ``z - log E`` over the kept set, i.e. the token of the race over the
sorted-and-cut row (``backends/torch_native/sampling.py`` gives the argument), so seeded rows keep their
tokens across the two algorithms up to float32 rounding at a cut's boundary.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._sampling_kernels import _max_step, _race_tile, _row_setup


@triton.jit
def _key(z):
    """Order-preserving int64 key of float32 ``z`` (a larger float, a larger key)."""
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.int64)


@triton.jit
def _z(x_row, offs, valid, m, t):
    x = tl.load(x_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    return (x - m) / t


@triton.jit
def _topk_mass(x_row, cols, n_cols, m, t, k, BLOCK: tl.constexpr):
    """The mass ``sum(exp z)`` of the tokens with ``z >=`` the row's k-th largest ``z`` (``1 <= k < n``): the
    k-th largest key by radix select (four passes, one 256-bin histogram of an 8-bit digit each, among the
    keys that match the digits chosen so far), then one pass for the sum."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.int64)
    kk = k
    for i in tl.static_range(4):
        shift = 24 - 8 * i  # constexpr: i is a static_range index
        hist = tl.zeros([256], tl.int32)
        start = n_cols * 0
        while start < n_cols:
            offs = start + cols
            valid = offs < n_cols
            uk = _key(_z(x_row, offs, valid, m, t)) + 2147483648  # [0, 2**32), order-preserving
            match = valid & ((uk >> (shift + 8)) == (prefix >> (shift + 8)))
            digit = ((uk >> shift) & 255).to(tl.int32)
            hist += tl.histogram(digit, 256, mask=match)
            start += BLOCK
        at_or_above = tl.flip(tl.cumsum(tl.flip(hist, 0), axis=0), 0)  # keys with this digit or a larger one
        b = tl.max(tl.where(at_or_above >= kk, bins, -1), axis=0)
        kk -= tl.sum(tl.where(bins > b, hist, 0), axis=0)
        prefix = prefix | (b.to(tl.int64) << shift)
    mass = tl.zeros([], tl.float32)
    start = n_cols * 0
    while start < n_cols:
        offs = start + cols
        valid = offs < n_cols
        z = _z(x_row, offs, valid, m, t)
        mass += tl.sum(tl.where(valid & (_key(z) + 2147483648 >= prefix), tl.exp(z), 0.0), axis=0)
        start += BLOCK
    return mass


@triton.jit
def _row_mass(x_row, cols, n_cols, m, t, BLOCK: tl.constexpr):
    """``sum(exp z)`` over the row."""
    mass = tl.zeros([], tl.float32)
    start = n_cols * 0
    while start < n_cols:
        offs = start + cols
        valid = offs < n_cols
        mass += tl.sum(tl.where(valid, tl.exp(_z(x_row, offs, valid, m, t)), 0.0), axis=0)
        start += BLOCK
    return mass


@triton.jit
def _reject_row(
    X,
    T,
    TOPK,
    TOPP,
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
    HAS_K: tl.constexpr,
    HAS_P: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_SEEDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    arg = n_cols * 0
    start = n_cols * 0
    while start < n_cols:
        offs = start + cols
        m, arg = _max_step(x_row, offs, offs < n_cols, m, arg)
        start += BLOCK
    t, greedy, mp, h0 = _row_setup(T, MINP, SEEDS, OFFS, BASE, row, greedy_below, HAS_T, HAS_MINP, HAS_SEEDS)
    k = n_cols
    if HAS_K:
        k64 = tl.load(TOPK + row).to(tl.int64)  # clamped before the cast: a huge k must not wrap
        k = tl.where((k64 <= 0) | (k64 > n_cols), n_cols, k64).to(tl.int32)
    p = 1.0
    if HAS_P:
        p = tl.load(TOPP + row).to(tl.float32)
    no_cut = (k >= n_cols) & (p >= 1.0)
    mass = tl.full([], 1.0, tl.float32)
    if HAS_P:
        if (p < 1.0) & (greedy == 0):
            if k < n_cols:
                mass = _topk_mass(x_row, cols, n_cols, m, t, k, BLOCK)
            else:
                mass = _row_mass(x_row, cols, n_cols, m, t, BLOCK)
    # rounds: test the last round's token (cz, ci), race among the tokens ranked above it
    cz = tl.full([], float("-inf"), tl.float32)
    ci = n_cols * 0 + n_cols
    check = n_cols * 0
    done = greedy.to(tl.int32)
    tok = arg
    while done == 0:
        cnt = n_cols * 0
        above = tl.zeros([], tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = n_cols * 0 + n_cols
        best_z = tl.full([], float("-inf"), tl.float32)
        start = n_cols * 0
        while start < n_cols:
            offs = start + cols
            valid = offs < n_cols
            z = _z(x_row, offs, valid, m, t)
            e = tl.exp(z)
            cnt += tl.sum((valid & (z > cz)).to(tl.int32), axis=0)
            ranked = valid & ((z > cz) | ((z == cz) & (offs < ci)))
            above += tl.sum(tl.where(ranked, e, 0.0), axis=0)
            cand = ranked
            if HAS_MINP:
                cand = cand & (e >= mp)
            if tl.max(cand.to(tl.int32), axis=0) > 0:  # the hash only for tiles with candidates left
                bm, bi = _race_tile(z, offs, cand, h0, tiny)
                bz = tl.max(tl.where(offs == bi, z, float("-inf")), axis=0)
                better = bm > best
                best = tl.where(better, bm, best)
                best_i = tl.where(better, bi, best_i)
                best_z = tl.where(better, bz, best_z)
            start += BLOCK
        ok = (check != 0) & (cnt < k) & ((above < p * mass) | (p >= 1.0))
        tok = tl.where(ok, ci, tl.where(no_cut, best_i, tok))
        done = (ok | no_cut).to(tl.int32)
        cz = tl.where(ok, cz, best_z)
        ci = tl.where(ok, ci, best_i)
        check = n_cols * 0 + 1
    tl.store(OUT + row, tok.to(tl.int64))
