"""``triton.reshape_and_cache``: the paged KV-cache write in ONE Triton launch (vLLM's ``reshape_and_cache``
kernel, written in Triton), CUDA only (SM >= 8.0).

Why: ``torch_native.reshape_and_cache`` needs about 15 small torch launches (casts, masks, gathers, two
``index_put_``) to stay sync-free with -1 slots; on an H200 they were ~0.9 ms of a 2.5 ms batch-1 decode step
of a 28-layer model (benchmarks/results/engine/h200). This kernel reads each slot on the device and skips -1
slots itself. No host sync and ``torch.empty``-free, so it is CUDA-graph safe. Duplicate slots: which write
wins is unspecified (as in vLLM and ``index_put_``). Quantized caches (float8_e4m3fn, int8;
``LLM(kv_cache_dtype=...)``) are written with ``core.kv_quant``'s rounding in the same launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.kv_layout import cache_dims, nhd_view
from layerzero.core.specs import KernelSpec

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, kernel_scale, missing, next_pow2
from ._launch import launch, pdl_kwargs

KERNEL_ID = "triton.reshape_and_cache"
PRIORITY = 30
"""Above torch_native.reshape_and_cache (10): one launch instead of ~15 (measured on an H200 engine
profile)."""
QUANT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
"""The kernel's ``QUANT`` constexpr per quantized cache dtype (0: the cache holds K/V's own dtype)."""
_KERNELS = LazyModule("_cache_kernels")


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_layout: Any,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Write each token's K and V into its cache slot (vLLM's ``reshape_and_cache``).

    Args:
        k, v: ``[T, Hkv, D]`` in the cache's dtype (a float dtype for a quantized cache), ``stride(-1) == 1``
            (T tokens, Hkv KV heads, D head dim).
        kv_cache: ``[N, 2, P, Hkv, D]`` (``"NHD"``) or ``[N, 2, Hkv, P, D]`` (``"HND"``), written in place.
        slot_mapping: ``[T]`` int32/int64; token t goes to slot ``block * P + offset``; -1 skips the token.
        kv_layout: ``"NHD"`` / ``"HND"`` (or the KVLayout enum).
        k_scale, v_scale: a quantized cache's (float8_e4m3fn / int8) per-tensor scales: positive floats or 0-d
            / 1-element float32 tensors on the cache's device (read on the device: graph-safe); None = 1.0.
            Codes are ``core.kv_quant.quantize_kv``'s (same rounding, bit-equal).

    Returns:
        None. Raises nothing of its own (``lz.reshape_and_cache`` validated the inputs); Triton's compile or
        launch errors propagate (dispatch then falls back and charges the backend's health).
    """
    n = k.shape[0]
    if n == 0 or kv_cache.shape[0] == 0:
        return
    _, page, hkv, d = cache_dims(kv_cache, kv_layout)
    st = nhd_view(kv_cache, kv_layout).stride()  # [N, 2, P, Hkv, D] order whatever the layout
    slots = slot_mapping if slot_mapping.stride(0) == 1 else slot_mapping.contiguous()
    quant = QUANT_CODES.get(kv_cache.dtype, 0)
    ks, vs = kernel_scale(k_scale), kernel_scale(v_scale)
    launch(
        _KERNELS.get()._reshape_and_cache,
        (n, hkv),
        k,
        v,
        kv_cache,
        slots,
        ks,
        vs,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        st[0],
        st[1],
        st[2],
        st[3],
        page,
        d,
        D_PAD=max(16, next_pow2(d)),
        QUANT=quant,
        K_PTR=isinstance(ks, torch.Tensor),
        V_PTR=isinstance(vs, torch.Tensor),
        num_warps=1 if d <= 128 else 2,
        **pdl_kwargs(k, n),
    )


def kernel_spec(available: bool, why: str) -> KernelSpec:
    """The ``triton.reshape_and_cache`` KernelSpec; its callable raises ``BackendNotAvailableError`` (with
    ``why``) when ``available`` is False."""
    fn: Callable[..., Any] = reshape_and_cache if available else missing(KERNEL_ID, why)
    return KernelSpec(
        KERNEL_ID,
        "reshape_and_cache",
        fn,
        priority=PRIORITY,
        description="LayerZero Triton paged KV-cache write: one launch, -1 slots skipped on the device",
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        supports_backward=False,
        kv_cache_dtypes=frozenset(QUANT_CODES),
    )
