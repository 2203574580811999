"""``lz.paged_attention`` and ``lz.reshape_and_cache``: attention over a paged KV cache (the serving op).

Follows vLLM's PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention") and its ``reshape_and_cache`` / FlashInfer's paged KV conventions; the cache layouts
(``KVLayout``, ``cache_dims``) live in :mod:`layerzero.core.kv_layout`, :func:`allocate_kv_cache` and the
shared cache checks in :mod:`layerzero.ops.kv_cache`. See docs/paged_attention.md.

This module holds the ops (``paged_attention``, ``paged_attention_lse``), their selection contexts and
specs; the checks (:func:`prepare`, :class:`PagedKey`) live in :mod:`layerzero.ops._paged_checks` and the
hot path (:func:`run`, :func:`_hot_key`) in :mod:`layerzero.ops._paged_hot`, both re-exported here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.opdef import OpDef, define
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import device_spec, fail, inference_only
from ._paged_checks import (  # noqa: F401 - re-exported
    OP,
    PagedKey,
    _check_paged_values,
    _check_token_bounds,
    prepare,
)
from ._paged_hot import _LAYOUTS, _hot_key, _scale_kind, run  # noqa: F401 - re-exported
from .reshape_and_cache import CACHE_OP, CACHE_SPEC, CacheKey, context_cache, prepare_cache, reshape_and_cache  # noqa: F401

LSE_OP = "paged_attention_lse"


def context(key: PagedKey) -> SelectionContext:
    """The :class:`SelectionContext` of a paged_attention key: ``seq_len_q`` is 1 for decode (phase DECODE),
    else the num_tokens bucket (an upper bound of every q_len), at least 2: a call with ``cu_seqlens_q`` is
    never phase DECODE, even with one query token (decode-only kernels ignore cu_seqlens_q; cascade
    attention's shared level at batch 1 is such a call); ``seq_len_kv`` is ``bucket(max_blocks) * block_size``
    (an upper bound of every seq_len); ``kv_layout``, ``page_size`` (= block_size) and ``stride_last_1``
    exact."""
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
        is_causal=key.is_causal,
        scale_default=key.scale_default,
        stride_last_1=key.stride_last_1,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
        kv_layout=key.kv_layout.value,
        page_size=key.page_size,
        kv_dtype=key.kv_dtype,
    )


SHIPPED_TIE_MARGIN = 0.10
"""Shipped paged-attention timings within 10% of a bucket's fastest count as tied (``OperationSpec``): the key
holds the block-table width (the longest sequence), not the lengths, which stay on the device (reading them
would synchronize). The grid measured uniform and narrow length spreads; on a skewed batch the kernels' order
can flip inside one bucket: on the H200, ``triton.paged_decode`` 6% faster than FlashInfer at the grid point
(B4, width 8192, D256) was 16% slower at B3 with lognormal lengths around 5000. FlashInfer's plan balances
work over the real lengths; the margin lets its priority decide near-ties. (Dense attention's key holds the
exact shape up to the power-of-two buckets; a margin there flipped an H100 decode shape to 0.895:
``benchmarks/replay_hidden.py``.)"""

SPEC = OperationSpec(
    OP,
    "attention over a paged KV cache (decode and prefill/append, GQA, bottom-right causal)",
    ("q", "kv_cache", "block_tables", "seq_lens"),
    "reference.paged_attention",
    shipped_tie_margin=SHIPPED_TIE_MARGIN,
)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    kv_layout: str = "NHD",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new query tokens over a paged KV cache (vLLM PagedAttention, Kwon et al. 2023;
    FlashInfer's batch decode/prefill with paged KV), dispatched to the fastest eligible kernel.

    Shapes (T = num_tokens, B = batch, Hq/Hkv heads, D head dim, N = num_blocks, P = block_size in tokens,
    M = max_blocks per sequence):

    - q ``[T, Hq, D]``: the new tokens of every sequence, concatenated in sequence order.
    - kv_cache ``[N, 2, P, Hkv, D]`` (``kv_layout="NHD"``) or ``[N, 2, Hkv, P, D]`` (``"HND"``), K at index 0
      and V at 1 of dim 1, q's dtype and device (see :func:`lz.allocate_kv_cache`). The new tokens' K/V must
      already be written (:func:`lz.reshape_and_cache`).
    - block_tables ``[B, M]`` int32: sequence s's token t is at block ``block_tables[s, t // P]``, offset
      ``t % P``. Only the first ``ceil(seq_lens[s] / P)`` entries of a row are read (the rest may be padding).
    - seq_lens ``[B]`` int32: KV length of each sequence in tokens, INCLUDING the new tokens; ``<= M * P``.
    - cu_seqlens_q: None for decode (one query token per sequence, ``T == B``), else ``[B + 1]`` int32 prefix
      sums of the q_lens (``cu[0] == 0``, non-decreasing, ``cu[-1] == T``, ``q_len <= seq_len`` per sequence
      when causal). A sequence may be empty (q_len 0, seq_len 0); with ``is_causal=False`` it may have query
      tokens and no keys (seq_len 0: those rows are 0, and their lse -inf).

    ``is_causal``: aligned BOTTOM-RIGHT to each sequence's KV: query i of a sequence with q_len new tokens and
    kv_len keys attends keys ``j <= kv_len - q_len + i`` (decode sees every key). ``scale``: default
    ``1/sqrt(D)``. GQA/MQA: ``Hq % Hkv == 0``; KV head h serves query heads ``h*Hq/Hkv ... (h+1)*Hq/Hkv - 1``.
    Returns ``[T, Hq, D]`` in q's dtype (fresh tensor). Values in cache slots that no sequence uses (other
    blocks, the tail of a last block) never reach the output, even NaN.

    Quantized cache (vLLM ``kv_cache_dtype="fp8"``): a ``torch.float8_e4m3fn`` or ``torch.int8`` cache holds
    codes; keys are read as ``codes.float() * k_scale`` and values as ``codes.float() * v_scale`` (per-tensor
    scales: a finite float > 0 or a 0-d/1-element float32 tensor on the cache's device; None = 1.0, vLLM's
    default). q may be any float dtype; the output has q's dtype. Only kernels that declare the cache dtype
    run (the others are refused with ``KV_CACHE_DTYPE_UNSUPPORTED``). Scales with an unquantized cache raise.

    ``return_lse=True`` (cascade attention, see :func:`lz.merge_attention_states
    <layerzero.merge_attention_states>`) returns ``(out, lse)``: lse ``[T, Hq]`` float32 is each row's
    natural-log sum of ``exp(scale * q·k)`` over the keys it attends (-inf, with an output row of 0, where it
    attends none: e.g. ``is_causal=False`` never masks, so only a zero-length sequence has such rows). It
    dispatches as op ``paged_attention_lse``, whose kernels declare the lse
    (``lz.explain("paged_attention_lse", ...)``); the inputs are checked as here.

    Index values (seq_lens, cu_seqlens_q, used block ids) are checked on CPU tensors always; on CUDA only when
    ``lz.get_config().strict`` is True, because reading them costs a device sync (out-of-range ids on CUDA
    without strict mode are undefined behaviour, as in vLLM).

    Raises:
        InvalidInputError: ranks/shapes per layout, dtypes (q and cache float and equal; index tensors int32
            on q's device), ``Hq % Hkv != 0``, head_dim mismatch, unknown ``kv_layout``, bad
            ``scale``/``is_causal``, B disagreeing between block_tables, seq_lens and cu_seqlens_q, ``T != B``
            for decode, ``T > B * M * P`` (so any query token with ``B == 0`` or ``M == 0``), query tokens
            with an empty (``N == 0``) cache (these from shapes only, on every device), and (see above)
            seq_lens outside ``[0, M * P]``, non-monotonic or inconsistent cu_seqlens_q, ``q_len > seq_len``,
            used block ids outside ``[0, N)``.
        NoKernelFoundError: a lock names a kernel that cannot run these inputs (e.g. during CUDA graph
            capture).

    >>> import torch, layerzero as lz
    >>> cache = lz.allocate_kv_cache(4, 16, 2, 64, torch.float32)
    >>> q = torch.randn(3, 8, 64)                                    # decode: 3 sequences, 1 token each
    >>> bt = torch.tensor([[0, 1], [2, 0], [3, 0]], dtype=torch.int32)
    >>> lens = torch.tensor([20, 5, 1], dtype=torch.int32)
    >>> lz.paged_attention(q, cache, bt, lens).shape
    torch.Size([3, 8, 64])
    """
    if return_lse is not False:
        if return_lse is not True:
            raise fail(OP, "return_lse", "a bool", repr(return_lse))
        return paged_attention_lse(
            q,
            kv_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            scale=scale,
            is_causal=is_causal,
            kv_layout=kv_layout,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if (
        (is_dynamo_compiling() or is_exporting())
        and k_scale is None
        and v_scale is None
        and inference_only(q, kv_cache)
    ):  # torch.compile, torch.export: one custom-op node (layerzero/custom_ops/_ops.py)
        return traced("paged_attention")(
            q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout
        )
    return run(
        OP,
        prepare,
        context,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        is_causal,
        kv_layout,
        k_scale,
        v_scale,
    )


# ------------------------------------------------------------------------------------- paged_attention_lse
def prepare_lse(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, **kwargs: Any
) -> tuple[PagedKey, tuple[Any, ...]]:
    """Validate as :func:`layerzero.ops.paged.prepare` (same arguments, same canonical kernel args); the key's
    op is ``paged_attention_lse``."""
    key, args = prepare(q, kv_cache, block_tables, seq_lens, **kwargs)
    return key._replace(op=LSE_OP), args


def context_lse(key: PagedKey) -> SelectionContext:
    """:func:`layerzero.ops.paged.context` with op ``paged_attention_lse``."""
    return dataclasses.replace(context(key), op=LSE_OP)


LSE_SPEC = OperationSpec(
    LSE_OP,
    "paged attention that also returns each row's log-sum-exp (cascade attention's levels)",
    ("q", "kv_cache", "block_tables", "seq_lens"),
    "reference.paged_attention_lse",
    shipped_tie_margin=SHIPPED_TIE_MARGIN,
)


def paged_attention_lse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    kv_layout: str = "NHD",
    k_scale: Any = None,
    v_scale: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lz.paged_attention(..., return_lse=True)`` (documented there): ``(out [T, Hq, D] in q's dtype, lse
    [T, Hq] float32)``, lse the natural-log sum of ``exp(scale * q·k)`` over the keys each row attends (-inf,
    with out 0, for a row that attends none)."""
    if (
        (is_dynamo_compiling() or is_exporting())
        and k_scale is None
        and v_scale is None
        and inference_only(q, kv_cache)
    ):
        return traced("paged_attention_lse")(
            q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout
        )
    return run(
        LSE_OP,
        prepare_lse,
        context_lse,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        is_causal,
        kv_layout,
        k_scale,
        v_scale,
    )


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        paged_attention,
        prepare,
        context,
        kernel_args=(
            "q",
            "kv_cache",
            "block_tables",
            "seq_lens",
            "cu_seqlens_q",
            "scale",
            "is_causal",
            "layout",
        ),
        custom_ops=("paged_attention",),
    ),
    OpDef(
        LSE_SPEC,
        None,
        prepare_lse,
        context_lse,
        kernel_args=(
            "q",
            "kv_cache",
            "block_tables",
            "seq_lens",
            "cu_seqlens_q",
            "scale",
            "is_causal",
            "layout",
        ),
        custom_ops=("paged_attention_lse",),
    ),
)
