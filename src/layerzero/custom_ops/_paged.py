"""The paged KV-cache ops of :mod:`layerzero.custom_ops` as ``torch.library`` custom ops:
``lz.paged_attention`` (and its lse form), ``lz.merge_attention_states``, ``lz.reshape_and_cache``,
``lz.qk_norm_rope_cache`` and ``lz.rope_paged_attention`` (the last three mutate ``kv_cache``). Imported by
:mod:`layerzero.custom_ops._ops` (which re-exports every function here); it also imports on its own; the
conventions (fake implementations, fresh outputs) are that module's."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ._common import NS, _layout_str, _owned, eager


@torch.library.custom_op(f"{NS}::qk_norm_rope_cache", mutates_args=("kv_cache",))
def _qk_norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    position_ids: torch.Tensor,
    eps: float,
    interleaved: bool,
    kv_layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = eager("qk_norm_rope_cache")(
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
    inputs = (q, k, v, q_weight, k_weight, cos, sin, kv_cache, slot_mapping, position_ids)
    qo = _owned(qo, *inputs)
    return qo, _owned(ko, *inputs, qo)


@_qk_norm_rope_cache.register_fake
def _(
    q, k, v, q_weight, k_weight, cos, sin, kv_cache, slot_mapping, position_ids, eps, interleaved, kv_layout
):
    return q.new_empty(q.shape), k.new_empty(k.shape)


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
    position_ids: torch.Tensor,
    eps: float,
    interleaved: bool,
    kv_layout: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.layerzero.qk_norm_rope_cache`` (mutates ``kv_cache``) with ``lz.qk_norm_rope_cache``'s
    arguments (kv_layout as a string)."""
    return _qk_norm_rope_cache(
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
        float(eps),
        bool(interleaved),
        _layout_str(kv_layout),
    )


@torch.library.custom_op(f"{NS}::rope_paged_attention", mutates_args=("kv_cache",))
def _rope_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    position_ids: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],  # noqa: UP045
    eps: float,
    cu_seqlens_q: Optional[torch.Tensor],
    scale: Optional[float],  # noqa: UP045
    interleaved: bool,
    kv_layout: str,
) -> torch.Tensor:
    out = eager("rope_paged_attention")(
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
    return _owned(
        out,
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
        cu_seqlens_q,
    )


@_rope_paged_attention.register_fake
def _(
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
):
    return q.new_empty(q.shape)


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
    position_ids: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cu_seqlens_q: torch.Tensor | None,
    scale: float | None,
    interleaved: bool,
    kv_layout: Any,
) -> torch.Tensor:
    """``torch.ops.layerzero.rope_paged_attention`` (mutates ``kv_cache``) with ``lz.rope_paged_attention``'s
    arguments (kv_layout as a string)."""
    return _rope_paged_attention(
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
        float(eps),
        cu_seqlens_q,
        None if scale is None else float(scale),
        bool(interleaved),
        _layout_str(kv_layout),
    )


@torch.library.custom_op(f"{NS}::paged_attention", mutates_args=())
def _paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    scale: Optional[float],  # noqa: UP045
    is_causal: bool,
    kv_layout: str,
) -> torch.Tensor:
    out = eager("paged_attention")(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        is_causal=is_causal,
        kv_layout=kv_layout,
    )
    return _owned(out, q, kv_cache, block_tables, seq_lens, cu_seqlens_q)


@_paged_attention.register_fake
def _(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout):
    return q.new_empty(q.shape)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    kv_layout: Any,
) -> torch.Tensor:
    """``torch.ops.layerzero.paged_attention`` with ``lz.paged_attention``'s arguments."""
    return _paged_attention(
        q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, bool(is_causal), _layout_str(kv_layout)
    )


@torch.library.custom_op(f"{NS}::paged_attention_lse", mutates_args=())
def _paged_attention_lse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor],
    scale: Optional[float],  # noqa: UP045
    is_causal: bool,
    kv_layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = eager("paged_attention")(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        is_causal=is_causal,
        kv_layout=kv_layout,
        return_lse=True,
    )
    out = _owned(out, q, kv_cache, block_tables, seq_lens, cu_seqlens_q)
    return out, _owned(lse, q, kv_cache, block_tables, seq_lens, cu_seqlens_q, out)


@_paged_attention_lse.register_fake
def _(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def paged_attention_lse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    kv_layout: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.layerzero.paged_attention_lse``: ``lz.paged_attention(..., return_lse=True)``."""
    return _paged_attention_lse(
        q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, bool(is_causal), _layout_str(kv_layout)
    )


@torch.library.custom_op(f"{NS}::merge_attention_states", mutates_args=())
def _merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = eager("merge_attention_states")(out_a, lse_a, out_b, lse_b)
    out = _owned(out, out_a, lse_a, out_b, lse_b)
    return out, _owned(lse, out_a, lse_a, out_b, lse_b, out)


@_merge_attention_states.register_fake
def _(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.layerzero.merge_attention_states`` with ``lz.merge_attention_states``'s arguments."""
    return _merge_attention_states(out_a, lse_a, out_b, lse_b)


@torch.library.custom_op(f"{NS}::reshape_and_cache", mutates_args=("kv_cache",))
def _reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_layout: str
) -> None:
    eager("reshape_and_cache")(k, v, kv_cache, slot_mapping, kv_layout)


@_reshape_and_cache.register_fake
def _(k, v, kv_cache, slot_mapping, kv_layout):
    return None


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_layout: Any
) -> None:
    """``torch.ops.layerzero.reshape_and_cache`` (writes ``kv_cache`` in place)."""
    _reshape_and_cache(k, v, kv_cache, slot_mapping, _layout_str(kv_layout))
