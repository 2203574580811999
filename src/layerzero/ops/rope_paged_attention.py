"""``lz.rope_paged_attention``: the attention block of a decode layer in one call: optional per-head q/k
RMSNorm (Qwen3's q_norm / k_norm), RoPE, the new k / v written into a paged KV cache, then causal paged
attention of the new tokens over each sequence's whole KV (TensorRT-LLM's masked multi-head attention fuses
RoPE and the KV append into decode attention the same way). Validated with the checks of ``lz.qk_norm_rope``
(or ``lz.rope``), ``lz.reshape_and_cache`` and ``lz.paged_attention``, named for this op."""

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

from ._common import check_eps, device_spec, fail, inference_only
from .kv_cache import INDEX_DTYPES, KVLayout, check_index
from .paged import prepare as _prepare_paged
from .paged import prepare_cache as _prepare_cache
from .qk_norm_rope import prepare as _prepare_qknr
from .rope import prepare as _prepare_rope

OP = "rope_paged_attention"


class RopePagedKey(NamedTuple):
    """The selection-cache key of a call: ``lz.qk_norm_rope_cache``'s facts (``qk_norm``: the weights are
    given), then ``lz.paged_attention``'s (``batch`` and ``max_blocks`` bucketed, ``decode``: cu_seqlens_q is
    None, ``scale_default``); ``stride_last_1`` over every tensor input; ``capture``/``scope`` close it as
    every op's key."""

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
    qk_norm: bool
    page_size: int
    kv_layout: KVLayout
    slot_dtype: torch.dtype
    batch: int
    max_blocks: int
    decode: bool
    scale_default: bool
    stride_last_1: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    position_ids: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    interleaved: bool = False,
    kv_layout: str | KVLayout = "NHD",
) -> tuple[RopePagedKey, tuple[Any, ...]]:
    """Validate the inputs, all before anything is written: ``lz.qk_norm_rope``'s checks (``lz.rope``'s
    without weights) on ``q[None]`` / ``k[None]`` as BSHD, ``lz.reshape_and_cache``'s on k, v, the cache and
    the slots, and ``lz.paged_attention``'s (causal) on q, the cache, block_tables, seq_lens, cu_seqlens_q and
    scale, each named for this op; return (cache key, canonical kernel args ``(q, k, v, q_weight, k_weight,
    cos, sin, kv_cache, slot_mapping, position_ids, block_tables, seq_lens, cu_seqlens_q, scale, interleaved,
    kv_layout, eps)``, the layout a :class:`KVLayout`, scale as given).

    Raises:
        InvalidInputError: see :func:`rope_paged_attention`.
    """
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise fail(
                OP,
                f"{name} rank",
                "3 dims ([num_tokens, heads, D], token-major)",
                f"{t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__,
            )
    if (q_weight is None) != (k_weight is None):
        raise fail(
            OP,
            "q_weight / k_weight",
            "both [D] tensors (QK-norm, then RoPE) or both None (RoPE only)",
            f"q_weight {'None' if q_weight is None else 'a tensor'}, k_weight "
            f"{'None' if k_weight is None else 'a tensor'}",
            "Pass both of Qwen3's q_norm / k_norm weights.",
        )
    check_index(OP, "position_ids", position_ids, 1, q.device, INDEX_DTYPES)
    if position_ids.shape[0] != q.shape[0]:
        raise fail(OP, "position_ids shape", f"[num_tokens] = [{q.shape[0]}]", list(position_ids.shape))
    qb, kb, pos = q.unsqueeze(0), k.unsqueeze(0), position_ids.view(1, -1)
    if q_weight is None or k_weight is None:  # both None (checked above)
        rkey, (*_, interleaved, _) = _prepare_rope(
            qb, kb, cos, sin, position_ids=pos, interleaved=interleaved, layout="BSHD", op=OP
        )
        eps = check_eps(OP, eps)
    else:
        rkey, (*_, interleaved, _, eps) = _prepare_qknr(
            qb,
            kb,
            q_weight,
            k_weight,
            cos,
            sin,
            eps=eps,
            position_ids=pos,
            interleaved=interleaved,
            layout="BSHD",
            op=OP,
        )
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype in KV_QUANT_DTYPES:
        raise fail(
            OP,
            "kv_cache.dtype",
            f"q's dtype {q.dtype} (an unquantized pool)",
            kv_cache.dtype,
            "A quantized pool takes its scales: call lz.rope / lz.qk_norm_rope, "
            "lz.reshape_and_cache(k_scale=, v_scale=), then lz.paged_attention(k_scale=, v_scale=).",
        )
    ckey, (_, v, kv_cache, slot_mapping, lay) = _prepare_cache(k, v, kv_cache, slot_mapping, kv_layout, op=OP)
    pkey, _ = _prepare_paged(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        is_causal=True,
        kv_layout=lay,
        op=OP,
    )
    key = RopePagedKey(
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
        q_weight is not None,
        ckey.page_size,
        ckey.kv_layout,
        ckey.slot_dtype,
        pkey.batch,
        pkey.max_blocks,
        pkey.decode,
        pkey.scale_default,
        rkey.stride_last_1 and ckey.stride_last_1 and pkey.stride_last_1,
        rkey.requires_grad or ckey.requires_grad or pkey.requires_grad,
        pkey.deterministic,
        pkey.capture,
        pkey.scope,
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
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        interleaved,
        lay,
        eps,
    )


def context(key: RopePagedKey) -> SelectionContext:
    """The :class:`SelectionContext` of a cache key: paged attention's (``batch``, heads, ``seq_len_q`` 1 for
    decode so phase DECODE, else ``max(2, num_tokens bucket)``; ``seq_len_kv`` = ``max_blocks * page_size``;
    causal, ``scale_default``, ``kv_layout``, ``page_size``) plus RoPE's ``rotary_dim`` and
    ``interleaved``."""
    return SelectionContext(
        op=OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.batch,
        num_heads_q=key.num_heads_q,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        head_dim_v=key.head_dim,
        seq_len_q=1 if key.decode else max(2, key.num_tokens),
        seq_len_kv=key.max_blocks * key.page_size,
        seq_equal=False,
        is_causal=True,
        scale_default=key.scale_default,
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
    "optional per-head q/k RMSNorm, RoPE, the new K/V written into a paged KV cache, then causal "
    "paged attention",
    ("q", "k", "v", "cos", "sin", "kv_cache", "slot_mapping", "block_tables", "seq_lens"),
    "reference.rope_paged_attention",
    key_type=RopePagedKey,
)


def rope_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    position_ids: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    interleaved: bool = False,
    kv_layout: str = "NHD",
) -> torch.Tensor:
    """A decode layer's attention block in one call: per-head RMSNorm of q and k when ``q_weight`` /
    ``k_weight`` are given (Qwen3's q_norm / k_norm), RoPE, the rotated k and ``v`` written into ``kv_cache``
    at ``slot_mapping`` IN PLACE, then causal paged attention of the new tokens over each sequence's whole KV;
    returns the attention output. Follows RoFormer's RoPE (Su et al. 2021), vLLM's PagedAttention and slot
    mapping (Kwon et al. 2023), and TensorRT-LLM's masked multi-head attention, which fuses RoPE and the KV
    append into decode attention.

    Shapes (T tokens, B sequences, Hq / Hkv heads, D head dim, R rotary dim, N blocks, P page size in tokens,
    M blocks per sequence), token-major as the paged ops take them: q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``
    (views of a packed QKV projection are fine); cos / sin a ``[max_pos, R]`` table read at ``position_ids``
    ``[T]`` (int64/int32); ``q_weight`` / ``k_weight`` ``[D]`` in q's dtype, both given (QK-norm then RoPE, as
    :func:`layerzero.qk_norm_rope`) or both None (RoPE only, as :func:`layerzero.rope`); ``kv_cache``
    ``[N, 2, P, Hkv, D]`` (``kv_layout="NHD"``) or ``[N, 2, Hkv, P, D]`` ("HND") in q's dtype;
    ``slot_mapping`` ``[T]`` int64/int32, ``block * P + offset``, -1 skips a token's write; ``block_tables``
    ``[B, M]`` int32; ``seq_lens`` ``[B]`` int32, each sequence's KV length INCLUDING its new tokens;
    ``cu_seqlens_q`` None (decode: T == B, one token per sequence) or ``[B + 1]`` int32 prefix sums of the q
    lengths (prefill / append). ``eps`` (> 0) is added to each head's mean square; ``scale`` defaults to
    ``1/sqrt(D)``. Always causal, aligned bottom-right as ``lz.paged_attention(is_causal=True)``. Returns
    ``[T, Hq, D]`` in q's dtype (a fresh tensor).

    Equal to ``q, k = lz.qk_norm_rope(q[None], k[None], q_weight, k_weight, cos, sin,
    position_ids=position_ids[None],
    layout="BSHD")`` (``lz.rope`` without weights), ``lz.reshape_and_cache(k[0], v, kv_cache, slot_mapping,
    kv_layout)``, then ``lz.paged_attention(q[0], kv_cache, block_tables, seq_lens, cu_seqlens_q=cu_seqlens_q,
    scale=scale, is_causal=True, kv_layout=kv_layout)``, given that each sequence's new tokens are its last
    positions and ``slot_mapping`` holds their slots in ``block_tables`` (as an engine builds both;
    out-of-range values are undefined on CUDA as in ``lz.paged_attention``). Kernels:
    ``composite.rope_paged_attention`` (those lz calls, each selected on its own: the default),
    ``reference.rope_paged_attention`` (float32 math, the oracle), ``triton.rope_paged_decode`` (CUDA decode,
    opt in: one split kernel that also does the norm, RoPE and the KV write, taking the new token's K/V from
    registers at position ``seq_lens - 1``, then the merge; measured slower than the composite on the H200,
    see docs/paged_attention.md). Quantized pools are refused: their write and read take scales (call the
    three ops instead).

    Raises:
        InvalidInputError: q / k not 3-D; one of q_weight / k_weight without the other; position_ids not
            ``[T]`` ints on q's device; everything ``lz.qk_norm_rope`` (or ``lz.rope``) refuses of (q, k,
            weights, cos, sin, eps), ``lz.reshape_and_cache`` of (k, v, kv_cache, slot_mapping, kv_layout) and
            ``lz.paged_attention`` of (q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale): e.g. T != B
            without cu_seqlens_q, cu_seqlens_q not ``[B + 1]``; a quantized kv_cache. Nothing is written then.
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> cache = lz.allocate_kv_cache(4, 16, 2, 64, torch.float32)
    >>> q, k, v = torch.randn(3, 8, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)   # decode: 3 sequences
    >>> cos, sin = torch.ones(32, 64), torch.zeros(32, 64)
    >>> bt = torch.tensor([[0, 1], [2, 0], [3, 0]], dtype=torch.int32)
    >>> lens = torch.tensor([20, 5, 1], dtype=torch.int32)  # the new tokens counted
    >>> slots = torch.tensor([16 + 3, 2 * 16 + 4, 3 * 16 + 0])  # each at position lens - 1
    >>> pos = lens.long() - 1
    >>> lz.rope_paged_attention(q, k, v, cos, sin, cache, slots, bt, lens, position_ids=pos).shape
    torch.Size([3, 8, 64])
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(q, k, v, q_weight, k_weight, cos, sin):
        return traced("rope_paged_attention")(
            q,
            k,
            v,
            cos,
            sin,
            kv_cache,
            slot_mapping,
            block_tables,
            seq_lens,
            position_ids,
            q_weight,
            k_weight,
            eps,
            cu_seqlens_q,
            scale,
            interleaved,
            kv_layout,
        )
    key, args = prepare(
        q,
        k,
        v,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        position_ids=position_ids,
        q_weight=q_weight,
        k_weight=k_weight,
        eps=eps,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        interleaved=interleaved,
        kv_layout=kv_layout,
    )
    return RUNTIME.run(key, context, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        rope_paged_attention,
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
            "block_tables",
            "seq_lens",
            "cu_seqlens_q",
            "scale",
            "interleaved",
            "kv_layout",
            "eps",
        ),
        custom_ops=("rope_paged_attention",),
    ),
)
