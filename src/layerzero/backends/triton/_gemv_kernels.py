"""Triton skinny GEMM (``y = x @ W.T + b`` for 1-8 rows). Imported only after ``import triton`` succeeded.

Decode's projections read a whole weight matrix for one to a few rows of x; the work is the weight read, so
the kernels are laid out for bandwidth, not for tensor-core throughput:

- ``_gemv_rows`` (M = 1..8, padded to ``BM``, a power of two): each program owns ``BN`` output columns (weight
  rows, a few KiB each) and walks K in ``BK`` steps, each weight tile loaded once and multiplied into every
  row with float32 multiply-adds into a ``[BM, BN, BK]`` accumulator, summed once at the end. Small ``BN``
  gives enough programs (N / BN) to keep every SM's loads in flight even for N = 1024.
- ``_gemv_prefetch`` (M = 1..8, K <= 4096): each program owns ``BN`` output columns and loads its whole
  ``[BN, K]`` weight slab in one go *before* waiting for the previous kernel (:func:`gdc_enter`): weights are
  never written by a forward, so under programmatic dependent launch (a decode graph) the slab streams in
  while the kernel before it (an RMSNorm, attention) finishes, and every program has its whole slab in flight
  at once instead of one ``BK`` tile per loop step (the row kernel's loads wait on its multiply-adds). Then
  each row of x (``BM`` rows, padded to a power of two, unrolled) is multiplied in float32 and reduced once
  per output. With ``NORM`` the row is first RMS-normalized (``lz.rms_norm_linear``: each program normalizes
  the whole row itself, K <= 4096 values from L2), with ``RESIDUAL`` after adding the residual (program 0
  stores the sum, the new residual stream). With ``SWIGLU`` the row is ``silu(gate) * up``
  (``lz.swiglu_linear``: X the gate, R the up projection).
- ``_gemv_dot`` (M = 2..16): the rows padded to 16 and one ``tl.dot`` per ``[BN, BK]`` weight tile (Triton
  pipelines these loads), float32 accumulator.

K (in_features) is a compile-time constant: one compilation per projection width of a model (a handful), loop
bounds known to the compiler. Both add the bias in float32 and round once to the output dtype (as cuBLAS's
epilogue does); no split-K, so the result does not depend on scheduling (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ._gdc_kernels import gdc_enter


@triton.jit
def _gemv_rows(
    X,
    W,
    B,
    Out,
    M,
    N,
    stride_x,
    stride_w,
    stride_o,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel before any memory access
    pn = tl.program_id(0)
    rm = tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < M, rn < N
    w_rows = W + rn[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Out + rm[:, None] * stride_o + rn[None, :],
        y.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _gemv_prefetch(
    X,
    W,
    B,
    Out,
    M,
    N,
    stride_x,
    stride_w,
    stride_o,
    NW,
    R,
    RO,
    stride_r,
    stride_ro,
    eps,
    K: tl.constexpr,
    KP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    NORM: tl.constexpr = False,
    RESIDUAL: tl.constexpr = False,
    SWIGLU: tl.constexpr = False,
    PDL: tl.constexpr = False,
    TRIGGER_FIRST: tl.constexpr = False,
):
    pn = tl.program_id(0)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, KP)  # KP = K rounded up to a power of two
    n_ok, k_ok = rn < N, rk < K
    # the weight slab (and bias, norm weight) before the wait: parameters, which no kernel of a forward writes
    w = tl.load(
        W + rn[:, None].to(tl.int64) * stride_w + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
    )
    b = tl.zeros((BN,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)
    nw = tl.zeros((KP,), dtype=tl.float32)
    if NORM:
        nw = tl.load(NW + rk, mask=k_ok, other=0.0).to(tl.float32)
    gdc_enter(
        PDL, TRIGGER_FIRST
    )  # PDL-launched: wait for the previous kernel before reading x or writing Out
    wf = w.to(tl.float32)
    for m in tl.static_range(BM):
        m_ok = m < M
        x = tl.load(X + m * stride_x + rk, mask=k_ok & m_ok, other=0.0)
        if NORM:  # lz.rms_norm's prologue (each program normalizes the whole row itself)
            if RESIDUAL:  # the residual stream h = x + r, rounded to the input dtype; program 0 stores it
                x = (
                    x.to(tl.float32)
                    + tl.load(R + m * stride_r + rk, mask=k_ok & m_ok, other=0.0).to(tl.float32)
                ).to(X.dtype.element_ty)
                tl.store(RO + m * stride_ro + rk, x, mask=k_ok & m_ok & (pn == 0))
            xf = x.to(tl.float32)  # rounded as triton.rms_norm rounds: n to x's dtype, then n * weight
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
            x = ((xf * rstd).to(X.dtype.element_ty).to(tl.float32) * nw).to(X.dtype.element_ty)
        if (
            SWIGLU
        ):  # lz.swiglu's prologue: x is the gate, R the up projection; rounded as triton.swiglu rounds
            gf = x.to(tl.float32)
            act = (gf * tl.sigmoid(gf)).to(X.dtype.element_ty).to(tl.float32)
            u = tl.load(R + m * stride_r + rk, mask=k_ok & m_ok, other=0.0).to(tl.float32)
            x = (act * u).to(X.dtype.element_ty)
        y = tl.sum(wf * x.to(tl.float32)[None, :], axis=1) + b
        tl.store(Out + m * stride_o + rn, y.to(Out.dtype.element_ty), mask=n_ok & m_ok)


@triton.jit
def _gemv_dot(
    X,
    W,
    B,
    Out,
    M,
    N,
    stride_x,
    stride_w,
    stride_o,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel before any memory access
    pn = tl.program_id(0)
    rm = tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            W + rn[:, None].to(tl.int64) * stride_w + rk[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if UPCAST:  # the Triton interpreter's tl.dot mishandles bfloat16 (numpy has no such type)
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Out + rm[:, None] * stride_o + rn[None, :],
        acc.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


INTERPRETED = isinstance(_gemv_dot, InterpretedFunction)
"""True under ``TRITON_INTERPRET=1`` (CPU tests): ``_gemv_dot`` then takes float32 operands for bfloat16
inputs (``UPCAST``; the interpreter's ``tl.dot`` mishandles bfloat16)."""
