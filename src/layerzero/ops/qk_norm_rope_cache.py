"""``lz.qk_norm_rope_cache``: ``lz.qk_norm_rope`` on token-major q / k, with the rotated k and the new v
written into a paged KV cache in the same call (``lz.reshape_and_cache``'s write; SGLang fuses the KV write
into its RoPE kernel the same way). A decode layer of Qwen3 then runs one kernel where it ran two before
attention."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.kv_quant import KV_QUANT_DTYPES
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import device_spec, fail, inference_only
from .kv_cache import INDEX_DTYPES, KVLayout, check_index
from .paged import prepare_cache as _prepare_cache
from .qk_norm_rope import prepare as _prepare_qknr

OP = "qk_norm_rope_cache"


class QkNormRopeCacheKey(NamedTuple):
    """The selection-cache key of a call: ``lz.qk_norm_rope``'s facts (heads, head and rotary dims,
    interleaving, the cos/sin form) and ``lz.reshape_and_cache``'s (tokens bucketed, page size, KV layout,
    slot dtype); ``capture``/``scope`` close it as every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    cos_dtype: torch.dtype
    num_tokens: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    rotary_dim: int
    form: str
    interleaved: bool
    page_size: int
    kv_layout: KVLayout
    slot_dtype: torch.dtype
    stride_last_1: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    position_ids: torch.Tensor,
    eps: float = 1e-6,
    interleaved: bool = False,
    kv_layout: str | KVLayout = "NHD",
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate the inputs (``lz.qk_norm_rope``'s checks on ``q[None]`` / ``k[None]`` as BSHD, then
    ``lz.reshape_and_cache``'s on k, v, the cache and the slots, named for this op); return (cache key,
    canonical kernel args ``(q, k, v, q_weight, k_weight, cos, sin, kv_cache, slot_mapping, position_ids,
    interleaved, kv_layout, eps)``).

    Raises:
        InvalidInputError: see :func:`qk_norm_rope_cache`.
    """
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise fail(
                OP,
                f"{name} rank",
                "3 dims ([num_tokens, heads, D], token-major)",
                f"{t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__,
            )
    check_index(OP, "position_ids", position_ids, 1, q.device, INDEX_DTYPES)
    if position_ids.shape[0] != q.shape[0]:
        raise fail(OP, "position_ids shape", f"[num_tokens] = [{q.shape[0]}]", list(position_ids.shape))
    rkey, (qb, kb, q_weight, k_weight, cos, sin, pos, interleaved, _, eps) = _prepare_qknr(
        q.unsqueeze(0),
        k.unsqueeze(0),
        q_weight,
        k_weight,
        cos,
        sin,
        eps=eps,
        position_ids=position_ids.view(1, -1),
        interleaved=interleaved,
        layout="BSHD",
    )
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype in KV_QUANT_DTYPES:
        raise fail(
            OP,
            "kv_cache.dtype",
            f"q's dtype {q.dtype} (an unquantized pool)",
            kv_cache.dtype,
            "A quantized pool takes its scales: call lz.qk_norm_rope, then lz.reshape_and_cache(k_scale=, "
            "v_scale=).",
        )
    ckey, (_, v, kv_cache, slot_mapping, lay) = _prepare_cache(k, v, kv_cache, slot_mapping, kv_layout, op=OP)
    key = QkNormRopeCacheKey(
        OP,
        q.device,
        q.dtype,
        rkey.cos_dtype,
        ckey.num_tokens,
        rkey.num_heads_q,
        rkey.num_heads_kv,
        rkey.head_dim,
        rkey.rotary_dim,
        rkey.form,
        rkey.interleaved,
        ckey.page_size,
        ckey.kv_layout,
        ckey.slot_dtype,
        rkey.stride_last_1 and ckey.stride_last_1,
        rkey.requires_grad or ckey.requires_grad,
        ckey.deterministic,
        ckey.capture,
        ckey.scope,
    )
    return key, (
        q,
        k,
        v,
        q_weight,
        k_weight,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        position_ids,
        interleaved,
        lay,
        eps,
    )


def context(key: QkNormRopeCacheKey) -> SelectionContext:
    """The :class:`SelectionContext` of a cache key (``batch`` = num_tokens bucket, the rope and cache
    fields)."""
    return SelectionContext(
        op=OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.num_tokens,
        num_heads_q=key.num_heads_q,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        head_dim_v=key.head_dim,
        rotary_dim=key.rotary_dim,
        interleaved=key.interleaved,
        kv_layout=key.kv_layout.value,
        page_size=key.page_size,
        stride_last_1=key.stride_last_1,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


SPEC = OperationSpec(
    OP,
    "per-head RMSNorm of q and k, RoPE, and the new K/V written into a paged KV cache",
    ("q", "k", "v", "q_weight", "k_weight", "cos", "sin", "kv_cache", "slot_mapping"),
    "reference.qk_norm_rope_cache",
    key_type=QkNormRopeCacheKey,
)


def qk_norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    position_ids: torch.Tensor,
    eps: float = 1e-6,
    interleaved: bool = False,
    kv_layout: str = "NHD",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, RoPE (``lz.qk_norm_rope``), then the rotated k and ``v`` written into
    ``kv_cache`` at ``slot_mapping``, IN PLACE (``lz.reshape_and_cache``); returns the new ``(q, k)``. The
    attention of a Qwen3 layer's new tokens is then ``lz.paged_attention(q, kv_cache, ...)`` with no separate
    cache write. Follows Qwen3's q_norm / k_norm, RoFormer's RoPE (Su et al. 2021), vLLM's slot mapping, and
    SGLang's KV write fused into its RoPE kernel (``fused_set_kv_buffer``).

    Shapes (T tokens, Hq / Hkv heads, D head dim, R rotary dim, N blocks, P page size in tokens), token-major
    as the paged ops take them: q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (views of a packed QKV projection
    are fine), ``q_weight`` / ``k_weight`` ``[D]``, cos / sin a ``[max_pos, R]`` table read at
    ``position_ids`` ``[T]`` (int64/int32), ``kv_cache`` ``[N, 2, P, Hkv, D]`` (``kv_layout="NHD"``) or
    ``[N, 2, Hkv, P, D]`` ("HND") in q's dtype (quantized pools are refused: they need scales),
    ``slot_mapping`` ``[T]`` int64/int32, ``block * P + offset``, -1 skips a token (padding). Outputs like q
    and k.

    Equal to ``q, k = lz.qk_norm_rope(q[None], k[None], ..., layout="BSHD")`` then ``lz.reshape_and_cache(k,
    v, ...)`` up to the rounding of the norm (see :func:`layerzero.qk_norm_rope`; the cache holds exactly the
    returned k). Kernels: ``composite.qk_norm_rope_cache`` (the two lz calls, each selected on its own: the
    default), ``triton.qk_norm_rope_cache`` (CUDA: the qk_norm_rope kernel whose k programs also store k and
    v, one launch where two were; checked in Triton's interpreter, opt in with ``lz.prefer`` until it has run
    on a GPU), ``reference.qk_norm_rope_cache`` (float32 math, the oracle).

    Raises:
        InvalidInputError: q / k not 3-D, position_ids not ``[T]`` ints on q's device, everything
            ``lz.qk_norm_rope`` refuses of (q, k, weights, cos, sin, eps) and ``lz.reshape_and_cache`` of (k,
            v, kv_cache, slot_mapping, kv_layout), a quantized kv_cache.
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(q, k, v, q_weight, k_weight, cos, sin):
        return traced("qk_norm_rope_cache")(
            q,
            k,
            v,
            q_weight,
            k_weight,
            cos,
            sin,
            kv_cache,
            slot_mapping,
            position_ids,
            eps,
            interleaved,
            kv_layout,
        )
    key, args = prepare(
        q,
        k,
        v,
        q_weight,
        k_weight,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        position_ids=position_ids,
        eps=eps,
        interleaved=interleaved,
        kv_layout=kv_layout,
    )
    return RUNTIME.run(key, context, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        qk_norm_rope_cache,
        prepare,
        context,
        kernel_args=(
            "q",
            "k",
            "v",
            "q_weight",
            "k_weight",
            "cos",
            "sin",
            "kv_cache",
            "slot_mapping",
            "position_ids",
            "interleaved",
            "kv_layout",
            "eps",
        ),
        custom_ops=("qk_norm_rope_cache",),
    ),
)
