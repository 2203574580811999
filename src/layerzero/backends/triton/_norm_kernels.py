"""Triton RMSNorm forward (plain and fused residual add). Imported only after ``import triton`` succeeded.

One program per row. With ``ONE_PASS`` the row is held in registers (one read of x); otherwise (rows up to
65536) it is read in ``BLOCK``-element tiles: a first loop accumulates the float32 sum of squares, a second
reloads the row and writes y (and h). The host code (``norms.py``) picks both from its ``NormKnobs``. Rounding
follows Hugging Face ``LlamaRMSNorm`` (the reference's ``cast_before_weight=True``):
``n = x_f32 * rsqrt(mean(x_f32^2) + eps)`` is rounded to x's dtype, then multiplied by the weight in float32
and rounded once more to x's dtype. With a residual, ``h = x + r`` is rounded to x's dtype first and the norm
is taken of the rounded h (as a model's residual stream stores it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter


@triton.jit
def _rms_norm_fwd(
    X,
    R,
    W,
    Y,
    H,
    stride_x,
    stride_r,
    stride_y,
    stride_h,
    stride_w,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel before any memory access
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    r_row = R + row * stride_r
    y_row = Y + row * stride_y
    h_row = H + row * stride_h
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_row + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_row + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        n = (xf * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(W + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (n * w).to(Y.dtype.element_ty), mask=mask)
    else:
        # while loops, not range(n_cols): the interpreter cannot take a runtime bound as a range() argument
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        start = n_cols * 0
        while start < n_cols:
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0)
            if HAS_RES:
                r = tl.load(r_row + offs, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
                tl.store(h_row + offs, x, mask=mask)
            xf = x.to(tl.float32)
            acc += xf * xf
            start += BLOCK
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
        start = n_cols * 0
        while start < n_cols:
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0)
            if HAS_RES:  # recompute h from x and r (re-reading h would race with this program's own stores)
                r = tl.load(r_row + offs, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            n = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
            w = tl.load(W + offs * stride_w, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + offs, (n * w).to(Y.dtype.element_ty), mask=mask)
            start += BLOCK
