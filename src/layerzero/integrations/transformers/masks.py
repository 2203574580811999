"""The attention-mask function LayerZero registers with transformers: its ``"sdpa"`` mask function, made
consistent between eager calls and CUDA-graph capture.

transformers' ``sdpa_mask`` skips a purely causal mask (no padding, no window, Sq == Sk or Sq == 1) and lets
the attention call pass ``is_causal`` instead. Releases before ~5.20 never skip while a CUDA graph is being
captured (``is_tracing`` includes stream capture), so the captured forward would call attention with a
materialized bool mask while every eager call (and the side-stream warm-up of the PyTorch recipe) ran without
one: a different call, whose kernel choice was never prepared. Skipping needs no read of tensor values when
there is no padding mask, which is why newer transformers skip under capture too; :func:`capture_consistent`
does the same for every supported release.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _query_length(args: dict[str, Any]) -> int | None:
    """Sq from ``q_length`` (transformers >= 5.2x) or ``cache_position`` (older releases)."""
    if isinstance(args.get("q_length"), int):
        return args["q_length"]
    pos = args.get("cache_position")
    return int(pos.shape[0]) if isinstance(pos, torch.Tensor) and pos.dim() == 1 else None


def skippable_causal(args: dict[str, Any], causal_fn: Any) -> bool:
    """True when the mask ``sdpa_mask`` would build from ``args`` (its bound arguments, defaults applied) is
    the plain causal one that transformers itself skips in eager mode: skipping allowed, no padding mask, the
    causal mask function, no extra and/or mask functions, no local window reaching back past the start, and Sq
    == Sk (top-left = bottom-right alignment) or Sq == 1 (a decode query sees every key)."""
    extra = args.get("kwargs") or {}
    if not args.get("allow_is_causal_skip", True) or args.get("attention_mask") is not None:
        return False
    if args.get("mask_function", causal_fn) is not causal_fn or any(
        extra.get(name) is not None for name in ("and_mask_function", "or_mask_function")
    ):
        return False
    sq, sk = _query_length(args), args.get("kv_length")
    if sq is None or not isinstance(sk, int):
        return False
    local = args.get("local_size")
    if local is not None and sk >= local:
        return False
    offset = args.get("q_offset", 0)
    return (sq == 1 or sq == sk) and not isinstance(offset, torch.Tensor)


def capture_consistent(sdpa_mask_fn: Callable[..., Any], causal_fn: Any) -> Callable[..., Any]:
    """``sdpa_mask_fn`` that, while a CUDA graph is being captured, returns None (no mask: the attention call
    uses ``is_causal``) exactly where eager transformers skips the mask (:func:`skippable_causal`); otherwise
    it calls ``sdpa_mask_fn`` unchanged. ``causal_fn`` is transformers' ``causal_mask_function``."""
    sig = inspect.signature(sdpa_mask_fn)

    @functools.wraps(sdpa_mask_fn)
    def layerzero_mask(*args: Any, **kwargs: Any) -> Any:
        if _capturing():
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return sdpa_mask_fn(*args, **kwargs)
            bound.apply_defaults()
            if skippable_causal(dict(bound.arguments), causal_fn):
                return None
        return sdpa_mask_fn(*args, **kwargs)

    return layerzero_mask


__all__ = ["capture_consistent", "skippable_causal"]
