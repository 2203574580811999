"""Triton weight-only quantized GEMM (``y = x @ dequantize(W_q).T + b``). Imported only after
``import triton`` succeeded.

``_qgemm`` tiles ``[BM, BN]`` of the output and walks K in ``BK`` steps; the weight tile is loaded as codes
and decoded in registers, never written back (Marlin's / vLLM's weight-only GEMMs):

- int8 / fp8 (``GROUPED`` False): codes cast to x's dtype (exact: int8 codes are integers up to 127, fp8
  values fit fp16 / bf16) go straight into ``tl.dot``; the per-channel (or per-tensor) scale multiplies the
  float32 accumulator once at the end, which is the same product as scaling every weight first;
- int4 (``GROUPED``): two codes per byte (low nibble first), ``code - zero`` (an exact small integer) into
  ``tl.dot``, and each group's partial product times that group's scale added to the float32 accumulator;
  ``BK`` divides the group size, so a K tile never straddles two groups.

``_qgemv_rows`` is the decode variant (1-8 rows, as ``triton.gemv``'s row kernel): small ``BN`` so that even N
= 1024 gives enough programs to keep every SM's loads in flight, float32 multiply-adds into a ``[BM, BN, BK]``
accumulator (no tensor cores: the weight read is the work), the same decoding (int4 scaled per group before
the multiply-add, int8 / fp8 scaled once at the end).

Bias added in float32, one rounding to the output dtype; no split-K (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _int4_tile(w_rows, rk, mask_w, Z, S, rn, n_ok, stride_s, group):
    """int4 codes of a ``[BN, BK]`` weight tile in one group: (``code - zero`` float32, the group's scales
    ``[BN]``)."""
    byte = tl.load(w_rows + (rk // 2)[None, :], mask=mask_w, other=0)
    code = tl.where((rk % 2 == 0)[None, :], byte & 15, byte >> 4).to(tl.float32)
    zero = tl.load(Z + rn * stride_s + group, mask=n_ok, other=0).to(tl.float32)
    scale = tl.load(S + rn * stride_s + group, mask=n_ok, other=0.0)
    return code - zero[:, None], scale


@triton.jit
def _code_tile(w_rows, rk, mask_w):
    """int8 / fp8 values of a ``[BN, BK]`` weight tile as float32 (masked lanes 0). No ``other=``: a float8
    pointer's fill value cannot be given as a literal, so masked lanes are zeroed after the load."""
    return tl.where(mask_w, tl.load(w_rows + rk[None, :], mask=mask_w).to(tl.float32), 0.0)


@triton.jit
def _store(
    y,
    S,
    B,
    Out,
    rm,
    rn,
    m_ok,
    n_ok,
    stride_s,
    stride_o,
    GROUPED: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The float32 ``[BM, BN]`` result: int8 / fp8's per-channel (or per-tensor) scale, the bias, one
    rounding."""
    if not GROUPED:
        if PER_CHANNEL:
            y *= tl.load(S + rn * stride_s, mask=n_ok, other=0.0)[None, :]
        else:
            y *= tl.load(S)
    if HAS_BIAS:
        y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Out + rm[:, None] * stride_o + rn[None, :],
        y.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _qgemm(
    X,
    Wq,
    S,
    Z,
    B,
    Out,
    M,
    N,
    stride_x,
    stride_w,
    stride_s,
    stride_o,
    K: tl.constexpr,
    G: tl.constexpr,
    GROUPED: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < M, rn < N
    w_rows = Wq + rn[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        mask_w = n_ok[:, None] & k_ok[None, :]
        if UPCAST:  # the Triton interpreter's tl.dot mishandles bfloat16 (numpy has no such type)
            x = x.to(tl.float32)
        if GROUPED:
            w, scale = _int4_tile(w_rows, rk, mask_w, Z, S, rn, n_ok, stride_s, k0 // G)
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * scale[None, :]
        else:
            acc = tl.dot(x, tl.trans(_code_tile(w_rows, rk, mask_w).to(x.dtype)), acc)
    _store(acc, S, B, Out, rm, rn, m_ok, n_ok, stride_s, stride_o, GROUPED, PER_CHANNEL, HAS_BIAS)


@triton.jit
def _qgemv_rows(
    X,
    Wq,
    S,
    Z,
    B,
    Out,
    M,
    N,
    stride_x,
    stride_w,
    stride_s,
    stride_o,
    K: tl.constexpr,
    G: tl.constexpr,
    GROUPED: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pn = tl.program_id(0)
    rm = tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    m_ok, n_ok = rm < M, rn < N
    w_rows = Wq + rn[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BM, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        mask_w = n_ok[:, None] & k_ok[None, :]
        if GROUPED:
            w, scale = _int4_tile(w_rows, rk, mask_w, Z, S, rn, n_ok, stride_s, k0 // G)
            w = w * scale[:, None]
        else:
            w = _code_tile(w_rows, rk, mask_w)
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    _store(
        tl.sum(acc, axis=2), S, B, Out, rm, rn, m_ok, n_ok, stride_s, stride_o, GROUPED, PER_CHANNEL, HAS_BIAS
    )


INTERPRETED = isinstance(_qgemm, InterpretedFunction)
"""True under ``TRITON_INTERPRET=1`` (CPU tests): the dot then takes float32 operands (``UPCAST``)."""
