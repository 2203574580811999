"""``lz.reshape_and_cache``: write new tokens' K/V into a paged KV cache in place (vLLM
``reshape_and_cache``), plain or quantized (fp8 / int8 with scales). Its checks (:func:`prepare_cache`) are
shared by the ops that write the cache themselves (``lz.qk_norm_rope_cache``, ``lz.rope_paged_attention``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext, bucket
from layerzero.core.kv_quant import KV_QUANT_DTYPES
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import check_same, check_tensor, device_spec, fail, flags, inference_only, scope_token
from .kv_cache import (
    INDEX_DTYPES,
    KVLayout,
    check_cache,
    check_index,
    check_kv_scale,
    check_values,
    parse_layout,
)

CACHE_OP = "reshape_and_cache"


class CacheKey(NamedTuple):
    """The selection-cache key of one ``lz.reshape_and_cache`` call (``num_tokens`` bucketed; ``dtype`` is
    k's, ``kv_dtype`` the cache's when quantized, else None); ``stride_last_1``: k, v, kv_cache and
    slot_mapping all have stride(-1) == 1; ``capture``/``scope`` close it as every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    num_tokens: int
    num_heads_kv: int
    head_dim: int
    page_size: int
    kv_layout: KVLayout
    slot_dtype: torch.dtype
    kv_dtype: torch.dtype | None
    stride_last_1: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def prepare_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_layout: str | KVLayout = "NHD",
    *,
    k_scale: Any = None,
    v_scale: Any = None,
    op: str = CACHE_OP,
) -> tuple[CacheKey, tuple[Any, ...]]:
    """Validate ``lz.reshape_and_cache`` inputs; return (cache key, canonical kernel args ``(k, v, kv_cache,
    slot_mapping, kv_layout)``, plus ``(k_scale, v_scale)`` (None -> 1.0) when the cache is quantized).
    ``op``: the op named in errors and in the key (``lz.qk_norm_rope_cache`` checks its write here)."""
    check_tensor(op, "k", k, 3)
    check_tensor(op, "v", v, 3)
    lay = parse_layout(op, kv_layout)
    nb, bs, hkv, d = check_cache(op, kv_cache, lay)
    quant = kv_cache.dtype in KV_QUANT_DTYPES
    check_same(op, "kv_cache", kv_cache, "k", k, dtype=not quant)
    check_same(op, "kv_cache", kv_cache, "v", v, dtype=not quant)
    if quant:
        check_same(op, "k", k, "v", v)
    ks = check_kv_scale(op, "k_scale", k_scale, kv_cache)
    vs = check_kv_scale(op, "v_scale", v_scale, kv_cache)
    n = k.shape[0]
    if tuple(k.shape) != (n, hkv, d) or tuple(v.shape) != (n, hkv, d):
        raise fail(
            op,
            "k/v shape",
            f"[num_tokens, Hkv, D] = [{n}, {hkv}, {d}] (Hkv, D from the {lay.value} cache) for both",
            f"k {list(k.shape)}, v {list(v.shape)}",
        )
    check_index(op, "slot_mapping", slot_mapping, 1, k.device, INDEX_DTYPES)
    if slot_mapping.shape[0] != n:
        raise fail(op, "slot_mapping shape", f"[num_tokens] = [{n}]", list(slot_mapping.shape))
    if kv_cache.requires_grad:
        raise fail(op, "kv_cache.requires_grad", False, True, "The cache is written in place: detach it.")
    if n and check_values(slot_mapping):
        s = slot_mapping.long()
        total = nb * bs
        bad = (s < -1) | (s >= total)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise fail(
                op,
                f"slot_mapping[{i}]",
                f"-1 (skip) or a slot in [0, num_blocks * block_size) = [0, {total})",
                int(s[i]),
                "slot = block_id * block_size + offset.",
            )
    grad, det, capture, stride = flags(k, v, kv_cache, slot_mapping)
    key = CacheKey(
        op,
        k.device,
        k.dtype,
        bucket(n),
        hkv,
        d,
        bs,
        lay,
        slot_mapping.dtype,
        kv_cache.dtype if quant else None,
        stride,
        grad,
        det,
        capture,
        scope_token(),
    )
    args = (k, v, kv_cache, slot_mapping, lay)
    return key, (args + (ks, vs) if quant else args)


def context_cache(key: CacheKey) -> SelectionContext:
    """The :class:`SelectionContext` of a reshape_and_cache key (``batch`` = num_tokens bucket)."""
    return SelectionContext(
        op=CACHE_OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.num_tokens,
        num_heads_q=key.num_heads_kv,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        head_dim_v=key.head_dim,
        stride_last_1=key.stride_last_1,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
        kv_layout=key.kv_layout.value,
        page_size=key.page_size,
        kv_dtype=key.kv_dtype,
    )


CACHE_SPEC = OperationSpec(
    CACHE_OP,
    "write new tokens' K/V into a paged KV cache in place (slot -1 = skip)",
    ("k", "v", "kv_cache", "slot_mapping"),
    "reference.reshape_and_cache",
)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_layout: str = "NHD",
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Write the new tokens' keys and values into a paged KV cache, IN PLACE (vLLM ``reshape_and_cache``).

    Shapes (T = num_tokens, Hkv heads, D head dim, N blocks, P = block_size in tokens): k, v ``[T, Hkv, D]``
    in the cache's dtype and device; kv_cache ``[N, 2, P, Hkv, D]`` (``"NHD"``) or ``[N, 2, Hkv, P, D]``
    (``"HND"``); slot_mapping ``[T]`` int64 or int32: token t goes to block ``slot // P``, offset ``slot % P``
    (``slot = block_id * P + offset``); a slot of -1 skips the token (padding, as in vLLM). Slots of different
    tokens must differ. Returns None.

    Quantized cache (``torch.float8_e4m3fn`` / ``torch.int8``, vLLM ``kv_cache_dtype="fp8"``): k and v may be
    any float dtype (the same one) and are written as ``round_to_format(k / k_scale)`` /
    ``round_to_format(v / v_scale)`` in float32: fp8 e4m3 saturates at +-448 (round to nearest even), int8
    rounds half to even and clamps to [-127, 127]. Scales: a finite float > 0 or a 0-d/1-element float32
    tensor on the cache's device; None = 1.0.

    Slot values are checked on CPU always and on CUDA only when ``lz.get_config().strict`` is True (a sync).

    Raises:
        InvalidInputError: ranks/shapes per layout, dtype or device differing from the cache's, slot_mapping
            dtype/length, a slot outside ``[-1, N * P)``, a cache that requires grad, unknown ``kv_layout``.

    >>> import torch, layerzero as lz
    >>> cache = lz.allocate_kv_cache(2, 4, 1, 8, torch.float32)
    >>> k = v = torch.ones(3, 1, 8)
    >>> lz.reshape_and_cache(k, v, cache, torch.tensor([5, -1, 0]))
    >>> cache[1, 0, 1].sum().item(), cache[0, 1, 0].sum().item(), cache[0, 0, 1].sum().item()
    (8.0, 8.0, 0.0)
    """
    if (
        (is_dynamo_compiling() or is_exporting())
        and k_scale is None
        and v_scale is None
        and inference_only(k, v, kv_cache)
    ):
        return traced("reshape_and_cache")(k, v, kv_cache, slot_mapping, kv_layout)
    key, args = prepare_cache(k, v, kv_cache, slot_mapping, kv_layout, k_scale=k_scale, v_scale=v_scale)
    RUNTIME.run(key, context_cache, args)


# the op of this module, defined once (layerzero.core.opdef): every list of ops is derived from it
OPDEFS = define(
    OpDef(
        CACHE_SPEC,
        reshape_and_cache,
        prepare_cache,
        context_cache,
        kernel_args=("k", "v", "kv_cache", "slot_mapping", "layout"),
        custom_ops=("reshape_and_cache",),
    ),
)
