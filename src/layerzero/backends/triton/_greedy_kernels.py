"""``triton.sample_greedy``: the first argmax of each row of logits, split over vocabulary chunks. Imported
only after ``import triton`` succeeded.

A row's ``n_cols`` columns are cut into ``n_chunks`` contiguous chunks of ``chunk_len`` columns (a multiple of
``BLOCK``; the last chunk is shorter). Two launches:

1. ``_greedy_chunk`` ``(rows, chunks)``: one program per chunk streams it in ``BLOCK``-element tiles, keeping
   per lane (tile position) the largest value seen, the first column holding it, and the first NaN column. At
   the end the lanes are reduced to the chunk's partial: ``(NaN, first NaN column)`` when the chunk holds a
   NaN, else ``(max, first column of the max)``; a float32 value and an int32 column per chunk in ``PV`` /
   ``PI`` ``[rows, n_chunks]``. With ``DIRECT`` (one chunk per row) the program writes the answer to ``OUT``
   instead and there is no second launch.
2. ``_greedy_merge`` ``(rows,)``: the first chunk holding a NaN wins (its column is the row's first NaN); else
   the first chunk holding the largest partial (chunks are in column order, so that is the row's first
   maximum).

NaN never takes part in a comparison that decides the maximum: the running update is ``x > best``, false for a
NaN ``x``, and NaN partials are replaced by ``-inf`` before the merge's ``tl.max``. So the result does not
depend on whether a ``max`` ignores or propagates NaN (CUDA's ``maxnum`` ignores it; Triton's CPU
interpreter's ``np.maximum`` propagates it). Ties: a lane keeps its first column (strictly greater replaces),
the lanes' reduction takes the smallest column among lanes holding the maximum, the merge the first chunk. An
all ``-inf`` chunk reports its first column (lanes start at their own first column with ``-inf``), so an all
``-inf`` row gives 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter

_NONE = tl.constexpr(2147483647)  # int32 max: "no column" in the minimum reductions (a constexpr global)


@triton.jit
def _greedy_chunk(
    X,
    PV,
    PI,
    OUT,
    stride_r,
    stride_c,
    n_cols,
    chunk_len,
    n_chunks,
    BLOCK: tl.constexpr,
    CONTIG: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    gdc_enter(PDL)  # PDL-launched: wait for the kernel that wrote the logits before reading them
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = X + row * stride_r
    cols = tl.arange(0, BLOCK)
    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, n_cols)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = lo + cols  # an all -inf lane reports its first column
    nan_i = tl.full([BLOCK], _NONE, tl.int32)
    start = lo
    while start < hi:
        offs = start + cols
        if CONTIG:
            ptrs = x_row + offs
        else:
            ptrs = x_row + offs.to(tl.int64) * stride_c
        x = tl.load(ptrs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        nan_i = tl.minimum(nan_i, tl.where(x != x, offs, _NONE))
        up = x > best  # False for NaN: NaN never becomes a lane's maximum
        best = tl.where(up, x, best)
        best_i = tl.where(up, offs, best_i)
        start += BLOCK
    m = tl.max(best, axis=0)
    arg = tl.min(tl.where(best == m, best_i, _NONE), axis=0)
    first_nan = tl.min(nan_i, axis=0)
    has_nan = first_nan < _NONE
    if DIRECT:
        tl.store(OUT + row, tl.where(has_nan, first_nan, arg).to(tl.int64))
    else:
        part = row * n_chunks + chunk
        tl.store(PV + part, tl.where(has_nan, float("nan"), m))
        tl.store(PI + part, tl.where(has_nan, first_nan, arg))


@triton.jit
def _greedy_merge(PV, PI, OUT, n_chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    valid = c < n_chunks
    base = row * n_chunks
    v = tl.load(PV + base + c, mask=valid, other=float("-inf"))
    isn = v != v
    first_nan = tl.min(tl.where(isn, c, CHUNKS), axis=0)
    v = tl.where(isn, float("-inf"), v)
    first_max = tl.min(tl.where(valid & (v == tl.max(v, axis=0)), c, CHUNKS), axis=0)
    pick = tl.where(first_nan < CHUNKS, first_nan, first_max)
    tl.store(OUT + row, tl.load(PI + base + pick).to(tl.int64))
