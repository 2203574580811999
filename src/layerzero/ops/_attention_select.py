"""What selection sees of an ``lz.attention`` call: the cache key's fields (:class:`AttentionKey`), the
:class:`SelectionContext` built from them (:func:`context`), the layout adapter that calls a kernel in its
native layout (:func:`adapter`) and the capture-time variants of a key (:func:`capture_variants`), the last
two named by the op's ``OperationSpec``. Its own module so that :mod:`layerzero.ops.attention` (which
re-exports every name here) holds the op's checks-and-key path and its hot path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from layerzero.core.constraints import native_layout
from layerzero.core.context import SelectionContext
from layerzero.core.specs import KernelSpec, Layout, MaskKind

from ._attention_checks import OP
from ._common import device_spec


class AttentionKey(NamedTuple):
    """The selection-cache key of one ``lz.attention`` call: everything selection may depend on, named as the
    :class:`SelectionContext` fields that :func:`context` fills from it (lengths and batch bucketed to powers
    of two, :func:`~layerzero.core.context.bucket`). ``capture`` (a CUDA graph is being captured) and
    ``scope`` (the scoped-policy token) close every op's key; ``core.dispatch.capture_key`` flips
    ``capture``."""

    op: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    head_dim_v: int
    seq_len_q: int
    seq_len_kv: int
    seq_equal: bool
    layout: Layout
    mask: MaskKind
    is_causal: bool
    dropout: bool
    scale_default: bool
    stride_last_1: bool
    aligned_16: bool
    contiguous: bool
    requires_grad: bool
    deterministic: bool
    window_left: int | None
    window_right: int | None
    has_softcap: bool | None
    has_alibi: bool | None
    capture: bool
    scope: tuple[Any, ...]


def context(key: AttentionKey) -> SelectionContext:
    """The :class:`SelectionContext` of an attention cache key."""
    return SelectionContext(
        op=OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.batch,
        num_heads_q=key.num_heads_q,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        head_dim_v=key.head_dim_v,
        seq_len_q=key.seq_len_q,
        seq_len_kv=key.seq_len_kv,
        seq_equal=key.seq_equal,
        layout=key.layout,
        mask=key.mask,
        is_causal=key.is_causal,
        dropout=key.dropout,
        scale_default=key.scale_default,
        stride_last_1=key.stride_last_1,
        aligned_16=key.aligned_16,
        contiguous=key.contiguous,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
        window_left=key.window_left,
        window_right=key.window_right,
        has_softcap=key.has_softcap,
        has_alibi=key.has_alibi,
    )


def _transposed(fn):
    """BSHD <-> BHSD is one swap of dims 1 and 2 either way: views in, view of the output back."""

    def call(
        q, k, v, *rest
    ):  # rest: attn_mask, is_causal, scale, dropout_p[, window, softcap[, alibi_slopes]]
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *rest)
        return out.transpose(1, 2)

    return call


def adapter(spec: KernelSpec, ctx: SelectionContext, fn: Callable[..., Any]):
    """Call ``fn`` (``spec``'s callable) in its native layout: transpose q/k/v (views) and the output back
    when the input layout differs."""
    native = native_layout(spec, ctx.layout)
    if native is ctx.layout or native is None:
        return fn, (), 0.0
    return _transposed(fn), (f"{ctx.layout.value}->{native.value} (transpose views)",), 1.0


def capture_variants(key: AttentionKey) -> tuple[AttentionKey, ...]:
    """The capture-time keys of a causal, unmasked call with Sq == Sk that tracers make instead while a CUDA
    graph is being captured: the same call with the causal mask materialized as a bool mask
    (``is_causal=False``). transformers does that under capture (it cannot check position ids / padding
    without reading them), so a patched model's captured forward finds its choice prepared by its eager
    calls."""
    if key.mask is not MaskKind.NONE or not key.is_causal or not key.seq_equal:
        return ()
    fields = key._asdict()
    fields.update(mask=MaskKind.BOOL, is_causal=False)
    return (AttentionKey(**fields),)
