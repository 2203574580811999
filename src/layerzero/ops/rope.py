"""``lz.rope``: rotary position embeddings applied to q and k."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import MISS
from layerzero.core.observers import OBSERVERS
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import Layout, OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    exact_device,
    fail,
    flags,
    is_grad_enabled,
    scope_layers,
    scope_token,
    scope_token_of,
    stream_capturing,
)

OP = "rope"
_TENSOR = torch.Tensor


class RopeKey(NamedTuple):
    """The selection-cache key of one ``lz.rope`` call (``cos_dtype`` and ``form``, how cos/sin are given:
    ``"gathered"``/``"table"``/``"indexed"``, keep calls apart that kernels serve differently);
    ``capture``/``scope`` close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    cos_dtype: torch.dtype
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    rotary_dim: int
    form: str
    interleaved: bool
    layout: Layout
    stride_last_1: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


_LAYOUTS = {"BHSD": Layout.BHSD, "BSHD": Layout.BSHD, Layout.BHSD: Layout.BHSD, Layout.BSHD: Layout.BSHD}


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    layout: str | Layout = "BHSD",
    op: str = OP,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.rope`` inputs; return (cache key, canonical kernel args). ``op``: the op named in errors
    and in the key (``lz.qk_norm_rope`` checks its rope arguments here too)."""
    check_tensor(op, "q", q, 4)
    check_tensor(op, "k", k, 4)
    check_same(op, "q", q, "k", k)
    check_tensor(op, "cos", cos, (2, 3))
    check_tensor(op, "sin", sin, (2, 3))
    check_same(op, "q", q, "cos", cos, dtype=False)
    check_same(op, "cos", cos, "sin", sin)
    lay = _LAYOUTS.get(layout) if isinstance(layout, (str, Layout)) else None
    if lay is None:
        raise fail(op, "layout", "'BHSD' or 'BSHD'", repr(layout))
    if lay is Layout.BHSD:
        b, hq, s, d = q.shape
        bk, hkv, sk, dk = k.shape
    else:
        b, s, hq, d = q.shape
        bk, sk, hkv, dk = k.shape
    if (b, s, d) != (bk, sk, dk):
        raise fail(op, "k shape", f"the batch, sequence and head_dim of q ({b}, {s}, {d})", (bk, sk, dk))
    if cos.shape != sin.shape:
        raise fail(op, "sin shape", f"cos's shape {list(cos.shape)}", list(sin.shape))
    r = cos.shape[-1]
    if r == 0 or r % 2 or r > d:
        raise fail(op, "rotary dim (cos.shape[-1])", f"an even number in 2..{d} (head_dim)", r)
    if interleaved is not True and interleaved is not False:
        raise fail(op, "interleaved", "a bool", repr(interleaved))
    if cos.dim() == 3:
        if position_ids is not None:
            raise fail(
                op,
                "position_ids",
                "None when cos/sin are already gathered [B, S, R]",
                "a tensor",
                "Pass the [max_pos, R] table with position_ids, or the gathered [B, S, R] without.",
            )
        if cos.shape[0] not in (1, b) or cos.shape[1] != s:
            raise fail(op, "cos shape", f"[B or 1, S, R] = [{b}, {s}, {r}]", list(cos.shape))
        form = "gathered"
    elif position_ids is None:
        if cos.shape[0] < s:
            raise fail(op, "cos table rows", f">= S = {s} (positions 0..S-1)", cos.shape[0])
        form = "table"
    else:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int64, torch.int32):
            raise fail(
                op,
                "position_ids",
                "an int64/int32 tensor [B, S]",
                getattr(position_ids, "dtype", position_ids),
            )
        if position_ids.device != q.device:
            raise fail(op, "position_ids.device", q.device, position_ids.device)
        if position_ids.dim() != 2 or position_ids.shape[1] != s or position_ids.shape[0] not in (1, b):
            raise fail(op, "position_ids shape", f"[B or 1, S] = [{b}, {s}]", list(position_ids.shape))
        check_positions(op, position_ids, cos.shape[0])
        form = "indexed"
    grad, det, capture, stride = flags(q, k, cos, sin)
    key = RopeKey(
        op,
        q.device,
        q.dtype,
        cos.dtype,
        hq,
        hkv,
        d,
        r,
        form,
        interleaved,
        lay,
        stride,
        grad,
        det,
        capture,
        scope_token(),
    )
    return key, (q, k, cos, sin, position_ids, interleaved, lay)


def check_positions(op: str, position_ids: torch.Tensor, rows: int) -> None:
    """On a CPU ``position_ids``, raise :class:`InvalidInputError` for a value outside ``[0, rows)`` (the cos
    table's rows); tensors on other devices are not read (that would synchronize with the device). One
    ``aminmax`` pass."""
    if position_ids.is_cpu and position_ids.numel():
        lo, hi = (int(t) for t in torch.aminmax(position_ids))
        if lo < 0 or hi >= rows:
            raise fail(op, "position_ids values", f"in [0, {rows}) (rows of the cos table)", f"[{lo}, {hi}]")


def _exact_key(
    q: Any, k: Any, cos: Any, sin: Any, position_ids: Any, interleaved: Any, layout: Any
) -> tuple[Any, ...] | None:
    """The exact key of an ``lz.rope`` call (``Runtime.run_hot``, as ``lz.attention``'s): every shape and
    dtype as given, the device as -1 (CPU) or the CUDA index, ``position_ids``' dtype and shape,
    ``interleaved`` and the layout as passed, the stride and per-call flags. Only calls that passed every
    check file it, so a hit skips them (a CPU ``position_ids``' values are still checked per call: they
    change). None (the full path) for anything but plain tensors on one CPU or CUDA device, a bool
    ``interleaved`` and a str / Layout layout."""
    if (
        q.__class__ is not _TENSOR
        or k.__class__ is not _TENSOR
        or cos.__class__ is not _TENSOR
        or sin.__class__ is not _TENSOR
        or (interleaved is not True and interleaved is not False)
        or (layout.__class__ is not str and layout.__class__ is not Layout)
        or (position_ids is not None and position_ids.__class__ is not _TENSOR)
    ):
        return None
    dev = exact_device(q, k, cos, sin, position_ids)
    if dev is None:
        return None
    layers = scope_layers()
    return (
        OP,
        dev,
        q.dtype,
        k.dtype,
        cos.dtype,
        sin.dtype,
        q.shape,
        k.shape,
        cos.shape,
        sin.shape,
        None if position_ids is None else (position_ids.dtype, position_ids.shape),
        interleaved,
        layout,
        q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1,
        is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad),
        deterministic_enabled(),
        dev >= 0 and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )


def context(key: RopeKey) -> SelectionContext:
    """The :class:`SelectionContext` of a rope cache key."""
    return SelectionContext(
        op=key.op,
        device=device_spec(key.device),
        dtype=key.dtype,
        num_heads_q=key.num_heads_q,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        rotary_dim=key.rotary_dim,
        interleaved=key.interleaved,
        layout=key.layout,
        stride_last_1=key.stride_last_1,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


SPEC = OperationSpec(
    OP,
    "rotary position embedding (NeoX half rotation or GPT-J interleaved)",
    ("q", "k", "cos", "sin"),
    "reference.rope",
)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    layout: str = "BHSD",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embeddings (RoFormer, Su et al. 2021) applied to q and k; returns new ``(q, k)``.

    Shapes (B batch, Hq/Hkv heads, S tokens, D head dim, R rotary dim, even, R <= D): q ``[B, Hq, S, D]``, k
    ``[B, Hkv, S, D]`` for ``layout="BHSD"`` (``[B, S, H, D]`` for ``"BSHD"``). cos/sin, one of: already
    gathered ``[B or 1, S, R]`` (Hugging Face's ``LlamaRotaryEmbedding`` output; ``position_ids`` must be
    None); a table ``[max_pos, R]`` with ``position_ids [B or 1, S]`` (int64/int32); or a table with
    ``position_ids=None`` (positions 0..S-1). Dims >= R pass through (partial rotary). ``interleaved=False``:
    GPT-NeoX/Llama half rotation, cos = ``cat(f, f)``, equal to transformers' ``apply_rotary_pos_emb``; the
    two halves of cos/sin must be equal, as RoPE makes them (kernels may read one half: Liger's does), and
    arbitrary tables give kernel-dependent results. ``interleaved=True``: GPT-J pairs (x0, x1), (x2, x3)...,
    cos = ``repeat_interleave(f, 2)``. Outputs keep q's and k's dtypes.

    Under ``torch.compile`` / ``torch.export`` the call is one ``torch.ops.layerzero.rope`` node, also when
    q/k or cos/sin (learned tables) require grad (backward formulas: ``layerzero/custom_ops/_grad.py``).

    Raises:
        InvalidInputError: ranks, dtypes, devices, R odd / > D, cos/sin shape mismatch, position_ids shape,
            dtype or (for CPU tensors; checking would sync a GPU) values outside the table, position_ids with
            gathered cos/sin.

    >>> import torch, layerzero as lz
    >>> q = torch.tensor([[[[1.0, 0.0]]]]); cos = torch.zeros(1, 1, 2); sin = torch.ones(1, 1, 2)
    >>> lz.rope(q, q, cos, sin)[0]  # rotate by 90 degrees
    tensor([[[[0., 1.]]]])
    """
    if (
        is_dynamo_compiling() or is_exporting()
    ):  # one custom-op node (custom_ops/_ops.py; backward formula: custom_ops/_grad.py)
        return traced("rope")(q, k, cos, sin, position_ids, interleaved, layout)
    hot_key = _exact_key(q, k, cos, sin, position_ids, interleaved, layout)
    plan = None if hot_key is None else RUNTIME.cache.hot.get(hot_key)
    if plan is not None:  # a call with these exact facts passed every check: only position values are left
        if position_ids is not None:
            check_positions(OP, position_ids, cos.shape[0])
        args = (q, k, cos, sin, position_ids, interleaved, _LAYOUTS[layout])
        if OBSERVERS.none:  # Runtime.run_hot inlined (core/observers.py says when that is allowed and why)
            try:
                return plan.call(*args)
            except Exception as exc:  # noqa: BLE001 - recorded, then retried or re-raised as run_hot does
                return RUNTIME.hot_failure(plan, exc, args)
        out = RUNTIME.run_hot(hot_key, args)
        if out is not MISS:
            return out
    key, args = prepare(q, k, cos, sin, position_ids=position_ids, interleaved=interleaved, layout=layout)
    return RUNTIME.run(key, context, args, hot_key)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        rope,
        prepare,
        context,
        kernel_args=("q", "k", "cos", "sin", "position_ids", "interleaved", "layout"),
        custom_ops=("rope",),
    ),
)
