"""Triton paged KV-cache write. Imported only after ``import triton`` succeeded.

One program per (token, KV head): it reads the token's slot, and when the slot is >= 0 copies the head's K and
V rows (``D`` elements each) to ``cache[slot // P, 0/1, slot % P, head]``; a slot of -1 (vLLM's padding)
writes nothing. Strides are passed for every tensor (the cache is the ``[N, 2, P, Hkv, D]`` view of either
layout), the last dim is unit-stride. Values are stored as they are (K/V and the cache share a dtype), or, for
a quantized cache (``QUANT`` 1 = int8, 2 = float8_e4m3fn), as ``core.kv_quant.quantize_kv`` rounds them:
``y = x / scale`` in float32, int8: round half to even, clamp to [-127, 127]; fp8: clamp to +-448, then the
round-to-nearest-even cast. Scales are float arguments or pointers to a float32 element (``K_PTR`` /
``V_PTR``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gdc_kernels import gdc_enter


@triton.jit
def load_scale(S, IS_PTR: tl.constexpr):
    """A quantized cache's per-tensor scale: ``S`` itself (a float argument) or the float32 it points to (a
    device tensor, read on the device so graphs replay later values). Shared with ``_paged_kernels``."""
    s = S
    if IS_PTR:
        s = tl.load(S)
    return s


@triton.jit
def _round_half_even(y):
    """``torch.round`` of float32 ``y`` (half to even), exact: the fraction ``y - floor(y)`` is exact in
    float32."""
    r = tl.floor(y)
    f = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)


@triton.jit
def _round_to_e4m3(y):
    """Float32 ``y`` (``|y| <= 448``) rounded half to even onto the float8_e4m3fn grid, still in float32 (so
    the cast that follows is exact whatever its own tie rule: Triton's interpreter rounds ties away from
    zero). The grid step is ``2^(e - 3)`` for ``|y|`` in ``[2^e, 2^(e+1))``, e >= -6, and ``2^-9`` below
    (subnormals); powers of two are built from exponent bits, so every scaling is exact."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = tl.maximum(e, -6) - 3
    up = ((127 - step) << 23).to(tl.float32, bitcast=True)  # 2^-step
    down = ((127 + step) << 23).to(tl.float32, bitcast=True)  # 2^step
    # on |y|, the sign put back by a multiply: a negative value that rounds to zero stays -0.0, as torch's
    # cast keeps it (code 0x80, not 0x00; a unary minus would not do: the interpreter computes it as 0 - x)
    r = _round_half_even(tl.abs(y) * up) * down
    return r * tl.where(y.to(tl.int32, bitcast=True) < 0, -1.0, 1.0)


@triton.jit
def _to_code(x, scale, QUANT: tl.constexpr):
    y = tl.math.div_rn(
        x.to(tl.float32), scale
    )  # IEEE division, as torch's (plain `/` may be approximate on GPU)
    if QUANT == 1:
        y = _round_half_even(tl.minimum(tl.maximum(y, -128.0), 128.0))
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    else:
        y = _round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
    return y


@triton.jit
def _reshape_and_cache(
    K,
    V,
    Cache,
    Slots,
    KS,
    VS,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cp,
    stride_ch,
    page,
    head_dim,
    D_PAD: tl.constexpr,
    QUANT: tl.constexpr = 0,
    K_PTR: tl.constexpr = False,
    V_PTR: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    gdc_enter(PDL)  # PDL-launched: wait for the previous kernel before any memory access
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    mask = (d < head_dim) & (slot >= 0)
    safe = tl.maximum(slot, 0)
    base = Cache + (safe // page) * stride_cb + (safe % page) * stride_cp + h * stride_ch + d
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    if QUANT != 0:
        k = _to_code(k, load_scale(KS, K_PTR), QUANT)
        v = _to_code(v, load_scale(VS, V_PTR), QUANT)
    tl.store(base, k.to(Cache.dtype.element_ty), mask=mask)
    tl.store(base + stride_ckv, v.to(Cache.dtype.element_ty), mask=mask)
