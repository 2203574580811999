"""Split-vocabulary ``lz.sample`` race: ``_race_row``'s result from a grid of ``(rows, chunks)`` programs, for
batches too small to fill the GPU with one program per row. Imported only after ``import triton`` succeeded.

The row's ``n_cols`` columns are cut into ``n_chunks`` chunks of ``chunk_len`` columns (a multiple of
``BLOCK``; the last chunk is shorter). Three launches, partial results in two ``[rows, 2, n_chunks]`` buffers
(float32 ``FP``: chunk maxima, then chunk best scores; int32 ``IP``: their first indices):

1. ``_split_max`` ``(rows, chunks)``: each chunk's max logit and the first column holding it;
2. ``_split_race`` ``(rows, chunks)``: the row max ``m`` from the chunk maxima, then the race over the chunk
   with ``_race_row``'s own expressions (``z = (x - m) / t``, the min-p cut ``exp(z) < min_p``, the counter
   noise of (seed, offset, column)) -> the chunk's best score and its first column (nothing raced on greedy
   rows);
3. ``_split_merge`` ``(rows,)``: the largest chunk score and the smallest column among chunks holding it (and
   the greedy token, the first column of the row max, the same way) -> ``OUT``.

Why bit-identical to ``_race_row``: each element's score is the same float32 expression of the same inputs,
and ``_race_row``'s running fold (``best_i = where(bm > best, bi, best_i)``, ``best = maximum(best, bm)``)
yields the smallest column among those holding the largest score (0 when no score beats ``-inf``), which the
chunk fold then the merge reproduce: per chunk the same fold from ``(-inf, 0)``, then the first chunk reaching
the max. On CUDA ``maximum`` / ``tl.max`` ignore NaN (``maxnum``), so NaN scores (all ``-inf`` rows, ``+inf``
logits, NaN logits) lose in both. Triton's CPU interpreter ignores NaN in ``tl.max`` (``np.nanmax``) but
propagates it in ``tl.maximum`` (``np.maximum``: a tile of all-NaN values freezes ``_race_row``'s fold); there
the two paths agree on NaN-free logits (an all ``-inf`` row or ``+inf`` logits included: both give column 0
for the race).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._sampling_kernels import _max_step, _race_step, _row_setup


@triton.jit
def _split_max(X, FP, IP, stride_x, n_cols, chunk_len, n_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, n_cols)
    m = tl.full([], float("-inf"), tl.float32)
    arg = n_cols * 0
    start = lo
    while start < hi:
        offs = start + cols
        m, arg = _max_step(x_row, offs, offs < hi, m, arg)
        start += BLOCK
    part = row * 2 * n_chunks + chunk
    tl.store(FP + part, m)
    tl.store(IP + part, arg)


@triton.jit
def _split_race(
    X,
    T,
    MINP,
    SEEDS,
    OFFS,
    BASE,
    FP,
    IP,
    stride_x,
    n_cols,
    chunk_len,
    n_chunks,
    greedy_below,
    tiny,
    HAS_T: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_SEEDS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    base = row * 2 * n_chunks
    cidx = tl.arange(0, CHUNKS)
    m = tl.max(tl.load(FP + base + cidx, mask=cidx < n_chunks, other=float("-inf")), axis=0)  # the row max
    t, greedy, mp, h0 = _row_setup(T, MINP, SEEDS, OFFS, BASE, row, greedy_below, HAS_T, HAS_MINP, HAS_SEEDS)
    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, n_cols)
    hi = tl.where(greedy, lo, hi)  # greedy rows take the row's argmax in _split_merge: no race
    best = tl.full([], float("-inf"), tl.float32)
    best_i = n_cols * 0
    start = lo
    while start < hi:
        offs = start + cols
        best, best_i = _race_step(x_row, offs, offs < hi, m, t, mp, h0, tiny, best, best_i, HAS_MINP)
        start += BLOCK
    part = base + n_chunks + chunk
    tl.store(FP + part, best)
    tl.store(IP + part, best_i)


@triton.jit
def _first_of_max(FP, IP, part, n_chunks, CHUNKS: tl.constexpr):
    # the index stored with the first of the n_chunks partial maxima at `part` holding their max (NaN partials
    # are ignored as tl.max ignores them; 0 when all are NaN and no chunk compares equal)
    cidx = tl.arange(0, CHUNKS)
    valid = cidx < n_chunks
    v = tl.load(FP + part + cidx, mask=valid, other=float("-inf"))
    first = tl.min(tl.where((v == tl.max(v, axis=0)) & valid, cidx, 2147483647), axis=0)
    return tl.load(IP + part + first, mask=first < n_chunks, other=0)


@triton.jit
def _split_merge(T, FP, IP, OUT, n_chunks, greedy_below, HAS_T: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * 2 * n_chunks
    greedy = False
    if HAS_T:
        greedy = tl.load(T + row).to(tl.float32) < greedy_below
    arg = _first_of_max(FP, IP, base, n_chunks, CHUNKS)
    best_i = _first_of_max(FP, IP, base + n_chunks, n_chunks, CHUNKS)
    tl.store(OUT + row, tl.where(greedy, arg, best_i).to(tl.int64))
