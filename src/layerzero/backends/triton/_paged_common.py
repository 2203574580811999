"""What the paged kernels' host code shares (:mod:`.paged`, :mod:`.cascade`; the SM count also
:mod:`.sampling` and :mod:`.attention`): the device's SM count, a quantized cache's scale arguments, and the
fused merge's counters. Here so that ``paged`` and ``cascade`` do not import each other. Nothing here imports
triton."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ._common import kernel_scale

__all__ = ["scale_args", "sm_count", "split_counters"]

_COUNTERS: dict[tuple[str, int, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
_COUNTERS_MIN = 4096


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (``multi_processor_count``, cached per device); 1
    elsewhere (the Triton interpreter on CPU)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def scale_args(quant: bool, k_scale: Any, v_scale: Any) -> tuple[Any, Any, dict[str, bool]]:
    """``(k_scale, v_scale, constexpr flags QUANT / K_PTR / V_PTR)`` of a paged kernel that reads a quantized
    cache (``paged_decode_split``, ``cascade``'s ``paged_prefill``): floats by value, tensors as pointers
    (read on the device); an unquantized cache passes 1.0 and no flags."""
    if not quant:
        return 1.0, 1.0, {}
    ks, vs = kernel_scale(k_scale), kernel_scale(v_scale)
    return (
        ks,
        vs,
        {"QUANT": True, "K_PTR": isinstance(ks, torch.Tensor), "V_PTR": isinstance(vs, torch.Tensor)},
    )


def split_counters(q: torch.Tensor, n: int) -> torch.Tensor:
    """The fused merge's int32 counters (at least ``n``, all 0 between launches: the last split of each
    (sequence, KV head) puts its counter back) for the stream the call runs on. One zeroed buffer per (device,
    current stream), made on first use and kept: a call reuses it, so a CUDA graph captures its address; under
    capture the zeroing is captured too (a memset node, harmless: the counters are 0 there anyway). A buffer
    that is outgrown is replaced and kept alive (graphs captured with it still point at it). Launches on
    different streams never share counters; graphs captured on one stream share its buffer, so two such graphs
    must not be replayed at the same time on two streams (as with every other buffer two graphs share through
    a memory pool)."""
    dev = q.device
    stream = torch._C._cuda_getCurrentRawStream(dev.index) if dev.type == "cuda" else 0
    key = (dev.type, -1 if dev.index is None else dev.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, _COUNTERS_MIN), dtype=torch.int32, device=dev)
    return buf
