"""The hot path of ``lz.paged_attention`` / ``lz.paged_attention_lse``: :func:`run` (an exact-key hit of
``Runtime.run_hot`` skips every check, a miss runs the op's ``prepare`` and selection) and the exact key it
looks up (:func:`_hot_key`, :func:`_scale_kind`). Its own module, apart from the checks
(:mod:`layerzero.ops._paged_checks`) and the op (:mod:`layerzero.ops.paged`, which re-exports every name
here), so that what a served call runs reads in one place."""

from __future__ import annotations

import math
from typing import Any

import torch

from layerzero.core import config as _config
from layerzero.core.dispatch import MISS
from layerzero.core.kv_quant import KV_QUANT_DTYPES
from layerzero.core.runtime import RUNTIME

from ._common import (
    deterministic_enabled,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
)
from ._paged_checks import OP
from .kv_cache import KVLayout

_TENSOR = torch.Tensor
_LAYOUTS = {"NHD": KVLayout.NHD, "HND": KVLayout.HND, KVLayout.NHD: KVLayout.NHD, KVLayout.HND: KVLayout.HND}


def run(
    op: str,
    prepare_fn: Any,
    context_fn: Any,
    q: Any,
    kv_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    cu: Any,
    scale: Any,
    is_causal: Any,
    kv_layout: Any,
    k_scale: Any,
    v_scale: Any,
) -> Any:
    """Dispatch a paged-attention call of ``op`` (``paged_attention`` or ``paged_attention_lse``): the hot
    path on an exact-key hit (:func:`_hot_key` of ``op``), else ``prepare_fn`` (full checks) and the runtime's
    selection with ``context_fn``."""
    hot_key = _hot_key(
        q, kv_cache, block_tables, seq_lens, cu, scale, is_causal, kv_layout, k_scale, v_scale, op=op
    )
    if hot_key is not None:
        args = (q, kv_cache, block_tables, seq_lens, cu, scale, is_causal, _LAYOUTS[kv_layout])
        if hot_key[-1] is not None:  # quantized cache: the scales (None -> 1.0) close the canonical args
            args += (1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale)
        out = RUNTIME.run_hot(hot_key, args)
        if out is not MISS:
            return out
    key, args = prepare_fn(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q=cu,
        scale=scale,
        is_causal=is_causal,
        kv_layout=kv_layout,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return RUNTIME.run(key, context_fn, args, hot_key)


def _scale_kind(s: Any, device: torch.device) -> str | None:
    """What a quantized cache's scale is, for the hot key: ``"none"``, ``"float"`` (a finite float > 0:
    checked here, its value is not keyed) or ``"tensor"`` (float32, one element, on ``device``; its value is
    checked as :func:`check_values` says); None for anything else (the full checks then run and raise)."""
    if s is None:
        return "none"
    if s.__class__ is float:
        return "float" if 0.0 < s < math.inf else None
    if (
        s.__class__ is _TENSOR
        and s.dtype is torch.float32
        and s.numel() == 1
        and s.dim() <= 1
        and s.device == device
    ):
        return "tensor"
    return None


def _hot_key(
    q: Any,
    kv_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    cu: Any,
    scale: Any,
    is_causal: Any,
    kv_layout: Any,
    k_scale: Any = None,
    v_scale: Any = None,
    *,
    op: str = OP,
) -> tuple[Any, ...] | None:
    """The exact key of a non-CPU call for ``Runtime.run_hot`` (as ``lz.attention``'s): every fact
    :func:`prepare` checks and the key depends on (exact shapes, dtypes, the devices equal, strides, flags,
    scale and layout as passed), so a hit proves a call with these facts passed the checks before, and skips
    them (measured on an H200 host: 62 µs per eager call locked to ``triton.paged_decode`` against 38 µs for
    the kernel alone). None (full checks every call) for CPU tensors and in strict mode, where index *values*
    are checked on every call (:func:`check_values`), and for anything but plain tensors, a bool
    ``is_causal``, a float or None ``scale``. The last item is None for an unquantized cache, else ``(cache
    dtype, k_scale kind, v_scale kind)`` (:func:`_scale_kind`: presence and type, never the value)."""
    if not (
        q.__class__ is _TENSOR
        and kv_cache.__class__ is _TENSOR
        and block_tables.__class__ is _TENSOR
        and seq_lens.__class__ is _TENSOR
        and (cu is None or cu.__class__ is _TENSOR)
        and (is_causal is True or is_causal is False)
        and (scale is None or scale.__class__ is float)
        and (kv_layout.__class__ is str or kv_layout.__class__ is KVLayout)
        and kv_layout in _LAYOUTS
    ):
        return None
    device = q.device
    if device.type == "cpu" or _config.get_config().strict:
        return None
    dtype = q.dtype
    if (
        kv_cache.device != device
        or block_tables.device != device
        or seq_lens.device != device
        or (cu is not None and cu.device != device)
    ):
        return None
    quant = None
    if kv_cache.dtype is not dtype:
        if kv_cache.dtype not in KV_QUANT_DTYPES:
            return None
        quant = (kv_cache.dtype, _scale_kind(k_scale, device), _scale_kind(v_scale, device))
        if quant[1] is None or quant[2] is None:
            return None
    elif k_scale is not None or v_scale is not None:
        return None
    tensors = (
        (q, kv_cache, block_tables, seq_lens) if cu is None else (q, kv_cache, block_tables, seq_lens, cu)
    )
    layers = scope_layers()
    return (
        op,
        device,
        dtype,
        q.shape,
        kv_cache.shape,
        block_tables.shape,
        block_tables.dtype,
        seq_lens.shape,
        seq_lens.dtype,
        None if cu is None else (cu.shape, cu.dtype),
        scale,
        is_causal,
        kv_layout,
        all(t.stride(-1) == 1 for t in tensors),
        is_grad_enabled() and any(t.requires_grad for t in tensors),
        deterministic_enabled(),
        q.is_cuda and stream_capturing(),
        scope_token_of(layers) if layers else (),
        quant,
    )
