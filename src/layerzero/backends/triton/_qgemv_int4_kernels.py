"""Triton int4 decode GEMV: ``y = x @ dequantize(W_q).T + b`` for 1-8 rows of x and a weight-only int4 weight
in groups of G along K. Imported only after ``import triton`` succeeded.

The weight as ``lz.quantize(w, "int4", group_size=G)`` stores it (GPTQ / AWQ's asymmetric grid,
docs/quantization.md): codes uint8 ``[N, K/2]`` (element ``2i`` of a row in the low nibble of byte ``i``,
``2i + 1`` in the high nibble), scale float32 and zero point uint8 ``[N, K/G]``; the weight is
``(code - zero) * scale`` per group.

``_qgemv_int4`` follows Marlin's point (Frantar et al. 2024, "MARLIN: Mixed-Precision Auto-Regressive Parallel
Inference on Large Language Models": at small batch a 4-bit weight is read up to 4x faster than a 16-bit one
if each byte is read once and decoded cheaply in registers) with ``triton.gemv``'s ``_gemv_prefetch``
structure:

- each program owns ``BN`` output columns (weight rows) and loads their packed bytes, each once, as one
  contiguous ``[BN, NGA * G/2]`` tile (16-byte vector loads), viewed as ``[BN, NGA, G/2]`` (groups apart),
  with the groups' scales and zero points ``[BN, NGA]``. NGA is a power of two; a row of K/G groups that is
  not one is split in two such parts (``NGA`` + ``NGB``: 24 groups as 16 + 8) rather than padded. Where the
  row fits (the slab mode, K up to the knob ``int4_chunk_k`` in ``quantized_linear.py``), the whole slab is
  issued *before* :func:`gdc_enter`: weights are never written by a forward, so under programmatic dependent
  launch (a decode graph) the slab streams in while the kernel before it finishes;
- each byte's nibbles become ``code - zero`` in float32 without an int-to-float conversion (Marlin's
  magic-number decode, here in float32): ``bitcast((b & 15) | 0x4B000000)`` is the float ``2**23 + code``
  exactly and subtracting ``2**23 + zero`` leaves ``code - zero`` exactly; the high nibble is used in place,
  ``bitcast((b & 0xF0) | 0x4B000000) - (2**23 + 16 * zero) = 16 * (code - zero)``, its sum times 1/16 (exact:
  powers of two). The magic bits come in as an argument (``MB``) so that the compiler keeps them in a register
  and each nibble costs one ``LOP3`` (and + or), one subtraction and one multiply-add;
- the low nibbles multiply x's even elements and the high nibbles its odd elements, loaded apart with a stride
  of 2 (x is a few KiB, cached): no interleave or gather. Per group, ``sum_j x[2j] * (lo_j - zero) + x[2j+1] *
  (hi_j - zero)`` in float32, times the group's scale, summed over the groups (the products of
  ``reference.quantized_linear``'s weight ``(code - zero) * scale``, in another float32 order); the bias added
  in float32, one rounding to the output dtype. The rows of x (``BM``, padded to a power of two) are unrolled
  and reuse the decoded slab;
- longer rows (the loop mode, K/G > NGA): chunks of NGA groups, the next chunk's loads issued before this
  chunk's math (double buffering), the first chunk before the PDL wait, a ``[BM, BN]`` float32 accumulator.

No split-K (deterministic); no tensor cores (at 1-8 rows the weight read is the work).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter

MAGIC_BITS = 0x4B000000
"""float32 bits of 2**23 (the ``MB`` argument): OR-ed with an integer below 2**23 it is the float
``2**23 + that``."""
_MAGIC = tl.constexpr(8388608.0)  # 2**23


@triton.jit
def _int4_chunk(
    Wq, S, Z, rn, n_ok, stride_w, stride_s, g0, NG: tl.constexpr, NGC: tl.constexpr, GH: tl.constexpr
):
    """Packed bytes ``[BN, NGC, GH]`` of groups ``g0 .. g0 + NGC`` of rows ``rn`` (0 past the last group or
    row), loaded as one contiguous ``[BN, NGC * GH]`` tile, and those groups' scales (float32, 0 where masked)
    and zero points (uint8) ``[BN, NGC]``."""
    rows = rn.to(tl.int64)
    rb = g0 * GH + tl.arange(0, NGC * GH)
    flat = tl.load(
        Wq + rows[:, None] * stride_w + rb[None, :], mask=n_ok[:, None] & (rb < NG * GH)[None, :], other=0
    )
    codes = tl.reshape(flat, (flat.shape[0], NGC, GH))
    rg = g0 + tl.arange(0, NGC)
    at = rows[:, None] * stride_s + rg[None, :]
    ok = n_ok[:, None] & (rg < NG)[None, :]
    return codes, tl.load(S + at, mask=ok, other=0.0), tl.load(Z + at, mask=ok, other=0)


@triton.jit
def _int4_decode(codes, zero, MB):
    """``(lo - zero, 16 * (hi - zero))`` float32 ``[BN, NGC, GH]`` of packed bytes ``[BN, NGC, GH]`` and zero
    points ``[BN, NGC]``, both exact (the magic-number decode; ``MB`` = :data:`MAGIC_BITS`)."""
    b = codes.to(tl.int32)
    z = zero.to(tl.float32)[:, :, None]
    lo = ((b & 15) | MB).to(tl.float32, bitcast=True) - (z + _MAGIC)
    hi = ((b & 240) | MB).to(tl.float32, bitcast=True) - (z * 16.0 + _MAGIC)
    return lo, hi


@triton.jit
def _int4_row(Xrow, lo, hi, scale, g0, m_ok, NG: tl.constexpr, NGC: tl.constexpr, GH: tl.constexpr):
    """One row of x (``Xrow`` points at it) times a decoded chunk (groups ``g0 .. g0 + NGC``): float32
    ``[BN]``. x's even and odd elements are loaded apart (stride 2) to meet the low and high nibbles."""
    rg = g0 + tl.arange(0, NGC)
    k = (rg * (2 * GH))[:, None] + 2 * tl.arange(0, GH)[
        None, :
    ]  # x's index of each byte's low nibble [NGC, GH]
    ok = (rg < NG)[:, None] & m_ok
    xe = tl.load(Xrow + k, mask=ok, other=0.0).to(tl.float32)
    xo = tl.load(Xrow + k + 1, mask=ok, other=0.0).to(tl.float32)
    part = tl.sum(lo * xe[None, :, :], axis=2) + tl.sum(hi * xo[None, :, :], axis=2) * 0.0625  # per group
    return tl.sum(part * scale, axis=1)


@triton.jit
def _qgemv_int4(
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
    MB,
    NG: tl.constexpr,
    GH: tl.constexpr,
    NGA: tl.constexpr,
    NGB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pn = tl.program_id(0)
    rn = pn * BN + tl.arange(0, BN)
    n_ok = rn < N
    # the weight's first chunk (in the slab mode both parts: the whole rows) and the bias before the wait:
    # parameters, which no kernel of a forward writes
    codes, scale, zero = _int4_chunk(Wq, S, Z, rn, n_ok, stride_w, stride_s, 0, NG, NGA, GH)
    if NGB > 0:
        codes2, scale2, zero2 = _int4_chunk(Wq, S, Z, rn, n_ok, stride_w, stride_s, NGA, NG, NGB, GH)
    b = tl.zeros((BN,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel before reading x or writing Out
    if NGA + NGB >= NG:  # slab mode: decode once, every row reuses it
        lo, hi = _int4_decode(codes, zero, MB)
        if NGB > 0:
            lo2, hi2 = _int4_decode(codes2, zero2, MB)
        for m in tl.static_range(BM):
            m_ok = m < M
            y = _int4_row(X + m * stride_x, lo, hi, scale, 0, m_ok, NG, NGA, GH) + b
            if NGB > 0:
                y += _int4_row(X + m * stride_x, lo2, hi2, scale2, NGA, m_ok, NG, NGB, GH)
            tl.store(Out + m * stride_o + rn, y.to(Out.dtype.element_ty), mask=n_ok & m_ok)
    else:  # loop mode: the next chunk's loads in flight during this chunk's math
        rm = tl.arange(0, BM)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for g0 in range(0, NG, NGA):
            codes_n, scale_n, zero_n = _int4_chunk(
                Wq, S, Z, rn, n_ok, stride_w, stride_s, g0 + NGA, NG, NGA, GH
            )
            lo, hi = _int4_decode(codes, zero, MB)
            for m in tl.static_range(BM):
                part = _int4_row(X + m * stride_x, lo, hi, scale, g0, m < M, NG, NGA, GH)
                acc += tl.where(rm[:, None] == m, part[None, :], 0.0)
            codes, scale, zero = codes_n, scale_n, zero_n
        y = acc + b[None, :]
        tl.store(
            Out + rm[:, None] * stride_o + rn[None, :],
            y.to(Out.dtype.element_ty),
            mask=(rm < M)[:, None] & n_ok[None, :],
        )
