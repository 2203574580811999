"""The attention-side ops of :mod:`layerzero.custom_ops` as ``torch.library`` custom ops:
``lz.attention`` (window split into two ints, layout as a string) and the positional encodings applied
to its q / k, ``lz.rope`` and ``lz.qk_norm_rope``.

Conventions (fake implementations, fresh contiguous outputs through :func:`_owned`) are those of
:mod:`layerzero.custom_ops._ops`, which imports this module and re-exports every wrapper here; it also
imports on its own (importing it registers its ops)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ._common import NS, _layout_str, _owned, eager


# -------------------------------------------------------------------------------------------- attention
@torch.library.custom_op(f"{NS}::attention", mutates_args=())
def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],  # noqa: UP045
    is_causal: bool,
    scale: Optional[float],
    dropout_p: float,
    layout: str,  # noqa: UP045
    window_left: Optional[int],
    window_right: Optional[int],  # noqa: UP045
    softcap: Optional[float],
    alibi_slopes: Optional[torch.Tensor] = None,
) -> torch.Tensor:  # noqa: UP045
    window = None if window_left is None or window_right is None else (window_left, window_right)
    out = eager("attention")(
        q,
        k,
        v,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        layout=layout,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )
    return _owned(out, q, k, v, attn_mask, alibi_slopes)


@_attention.register_fake
def _(
    q,
    k,
    v,
    attn_mask,
    is_causal,
    scale,
    dropout_p,
    layout,
    window_left,
    window_right,
    softcap,
    alibi_slopes=None,
):
    return q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
    layout: Any,
    window: Any,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.ops.layerzero.attention`` with ``lz.attention``'s arguments (layout as a string, window split,
    ``alibi_slopes`` ``[Hq]`` / ``[B, Hq]`` float32 or None)."""
    left, right = (None, None) if window is None else (-1 if w is None else int(w) for w in window)
    return _attention(
        q,
        k,
        v,
        attn_mask,
        bool(is_causal),
        scale,
        float(dropout_p),
        _layout_str(layout),
        left,
        right,
        softcap,
        alibi_slopes,
    )


# -------------------------------------------------------------------------------------------- rope
@torch.library.custom_op(f"{NS}::rope", mutates_args=())
def _rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: Optional[torch.Tensor],
    interleaved: bool,  # noqa: UP045
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = eager("rope")(q, k, cos, sin, position_ids=position_ids, interleaved=interleaved, layout=layout)
    qo = _owned(qo, q, k, cos, sin, position_ids)
    return qo, _owned(ko, q, k, cos, sin, position_ids, qo)


@_rope.register_fake
def _(q, k, cos, sin, position_ids, interleaved, layout):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    layout: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.layerzero.rope`` with ``lz.rope``'s arguments (layout as a string)."""
    return _rope(q, k, cos, sin, position_ids, bool(interleaved), _layout_str(layout))


@torch.library.custom_op(f"{NS}::qk_norm_rope", mutates_args=())
def _qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    position_ids: Optional[torch.Tensor],  # noqa: UP045
    interleaved: bool,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = eager("qk_norm_rope")(
        q,
        k,
        q_weight,
        k_weight,
        cos,
        sin,
        eps=eps,
        position_ids=position_ids,
        interleaved=interleaved,
        layout=layout,
    )
    inputs = (q, k, q_weight, k_weight, cos, sin, position_ids)
    qo = _owned(qo, *inputs)
    return qo, _owned(ko, *inputs, qo)


@_qk_norm_rope.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, position_ids, interleaved, layout):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    layout: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.layerzero.qk_norm_rope`` with ``lz.qk_norm_rope``'s arguments (layout as a string)."""
    return _qk_norm_rope(
        q, k, q_weight, k_weight, cos, sin, float(eps), position_ids, bool(interleaved), _layout_str(layout)
    )
