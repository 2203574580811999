"""Triton paged KV-cache write. Imported only after ``import triton`` succeeded.

One program per (token, KV head): it reads the token's slot, and when the slot is >= 0 copies the head's K and V
rows (``D`` elements each) to ``cache[slot // P, 0/1, slot % P, head]``; a slot of -1 (vLLM's padding) writes
nothing. Strides are passed for every tensor (the cache is the ``[N, 2, P, Hkv, D]`` view of either layout), the
last dim is unit-stride. Values are stored as they are (K/V and the cache share a dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache(K, V, Cache, Slots, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ckv,
                       stride_cp, stride_ch, page, head_dim, D_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    d = tl.arange(0, D_PAD)
    mask = (d < head_dim) & (slot >= 0)
    safe = tl.maximum(slot, 0)
    base = Cache + (safe // page) * stride_cb + (safe % page) * stride_cp + h * stride_ch + d
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(base, k, mask=mask)
    tl.store(base + stride_ckv, v, mask=mask)
