"""Quantized paged KV caches: the cache dtypes, their round-to-format and read-back rules, shared by the paged
ops and every paged kernel that reads or writes a quantized cache (backends import core, so the facts live
here once, like ``core/kv_layout.py``). docs/paged_attention.md, "Quantized KV caches", is the long form.

Semantics follow vLLM's ``kv_cache_dtype="fp8"`` (per-tensor scales ``k_scale`` / ``v_scale``, one pair per
layer):

- write: ``stored = round_to_format(x / scale)`` computed in float32; ``float8_e4m3fn``: saturating at +-448
  (the format's largest finite value; e4m3fn has no infinity), round to nearest even (torch's cast); ``int8``:
  symmetric, ``round`` half to even, clamped to ``[-127, 127]`` (-128 is never written, as in
  ``lz.quantize``'s int8).
- read: ``x' = stored.to(float32) * scale`` (float64 for float64 queries).

A scale is a positive finite Python number or a 0-d / 1-element float32 tensor on the cache's device; ``None``
means 1.0 (vLLM's default when a checkpoint ships no calibrated scales).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FP8_E4M3_MAX", "INT8_MAX", "KV_CACHE_DTYPES", "KV_QUANT_DTYPES", "dequantize_kv", "quantize_kv"]

KV_QUANT_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.int8})
"""Quantized cache dtypes: the cache holds codes, q and the output stay in the model's dtype."""
KV_CACHE_DTYPES: frozenset[torch.dtype] = (
    frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16}) | KV_QUANT_DTYPES
)
FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0


def quantize_kv(x: torch.Tensor, scale: Any, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (any float dtype) -> codes of ``dtype`` (``float8_e4m3fn`` or ``int8``):
    ``round_to_format(x / scale)`` in float32 (see the module docstring). ``scale``: a positive float or a
    0-d/1-element float32 tensor."""
    y = x.float() / scale
    if dtype == torch.int8:
        return torch.round(y).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize_kv(codes: torch.Tensor, scale: Any, work: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes of a quantized cache -> ``codes.to(work) * scale`` in ``work`` (float32, or float64 for float64
    queries). An unquantized cache (a float dtype) is returned as ``codes.to(work)``."""
    if codes.dtype not in KV_QUANT_DTYPES:
        return codes.to(work)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(work)
    return codes.to(work) * scale
