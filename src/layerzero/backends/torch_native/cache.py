"""``torch_native.reshape_and_cache``: the paged KV-cache write, vectorized with ``index_put_``.

No host sync, so it is CUDA-graph safe. A slot of -1 (vLLM's padding convention) is redirected to the slot and
value of the first valid token (an identical duplicate write), or, when no token is valid, to slot 0 with slot
0's own value, so nothing outside the valid slots changes and no data-dependent shape is needed.
"""

from __future__ import annotations

import torch

from layerzero.core.kv_layout import cache_dims, nhd_view
from layerzero.core.kv_quant import KV_QUANT_DTYPES, quantize_kv
from layerzero.core.specs import KernelSpec

FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def reshape_and_cache(k, v, kv_cache, slot_mapping, kv_layout, k_scale=None, v_scale=None):
    """``lz.reshape_and_cache`` vectorized: one ``index_put_`` per K and V on ``[N, P, Hkv, D]`` views of the
    cache, no host sync (see the module docstring for the -1 slots). A quantized cache (float8_e4m3fn / int8)
    gets ``round_to_format(k / k_scale)`` (:func:`~layerzero.core.kv_quant.quantize_kv`). Returns None."""
    n = k.shape[0]
    if n == 0 or kv_cache.shape[0] == 0:
        return
    if kv_cache.dtype in KV_QUANT_DTYPES:
        k, v = quantize_kv(k, k_scale, kv_cache.dtype), quantize_kv(v, v_scale, kv_cache.dtype)
    _, p, _, _ = cache_dims(kv_cache, kv_layout)
    cache = nhd_view(kv_cache, kv_layout)  # [N, 2, P, Hkv, D], a view of either layout
    slots = slot_mapping.long()
    valid = slots >= 0
    any_valid = valid.any()
    first = valid.to(torch.int8).argmax()  # first valid token (0 when none is)
    tok = torch.where(valid, torch.arange(n, device=k.device), first)
    slots = torch.where(any_valid, slots[tok], 0)
    block, offset = slots // p, slots % p
    for which, src in ((0, k), (1, v)):
        view = cache[:, which]  # [N, P, Hkv, D]
        values = torch.where(any_valid, src[tok], view[0, 0])
        view.index_put_((block, offset), values)


def kernel_spec() -> KernelSpec:
    """The KernelSpec: priority 10 (above the reference's 0), CPU and CUDA, every float dtype, graph-safe."""
    return KernelSpec(
        "torch_native.reshape_and_cache",
        "reshape_and_cache",
        reshape_and_cache,
        priority=10,
        description="paged KV cache write: index_put_ on cache views, no host sync",
        device_types=frozenset({"cpu", "cuda"}),
        dtypes=FLOATS,
        deterministic=True,
        graph_safe=True,
        kv_cache_dtypes=KV_QUANT_DTYPES,
    )
