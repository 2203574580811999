"""Triton SwiGLU forward. Imported only after ``import triton`` succeeded.

One elementwise pass over ``[rows, I]``: a 2-D grid of (row, column block) programs, so wide rows (I up to
millions) and short ones use the same kernel without register pressure. Math in float32, rounded like Hugging
Face ``LlamaMLP`` (``ACT2FN["silu"](gate) * up``): ``s = g * sigmoid(g)`` in float32 rounded to the input
dtype, then ``s * u`` in float32 rounded once more to the input dtype. ``BLOCK`` (columns per program) comes
from the host code's ``SwigluKnobs`` (``swiglu.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter


@triton.jit
def _swiglu_fwd(
    G, U, Out, stride_g, stride_u, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel before any memory access
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf * tl.sigmoid(gf)).to(g.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (s * u.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)
