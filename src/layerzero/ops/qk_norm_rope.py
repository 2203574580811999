"""``lz.qk_norm_rope``: per-head RMSNorm of q and k, then rotary position embeddings, in one call (Qwen3's
attention: ``q_norm`` / ``k_norm`` before RoPE; vLLM's ``fused_qk_norm_rope``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.dispatch import MISS
from layerzero.core.observers import OBSERVERS
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import check_eps, check_same, check_tensor, exact_device, fail, inference_only, is_grad_enabled
from .rope import _LAYOUTS, check_positions
from .rope import _exact_key as _rope_exact_key
from .rope import context as _rope_context
from .rope import prepare as _prepare_rope

OP = "qk_norm_rope"
_TENSOR = torch.Tensor


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float = 1e-6,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    layout: str = "BHSD",
    op: str = OP,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.qk_norm_rope`` inputs (``lz.rope``'s checks, then the weights and eps); return (cache
    key, canonical kernel args). ``op``: the op named in errors and in the key (``lz.rope_paged_attention``
    checks its norm and rope arguments here)."""
    key, (q, k, cos, sin, position_ids, interleaved, lay) = _prepare_rope(
        q, k, cos, sin, position_ids=position_ids, interleaved=interleaved, layout=layout, op=op
    )
    d = key.head_dim
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(op, name, w, 1)
        check_same(op, "q", q, name, w)
        if w.shape[0] != d:
            raise fail(
                op,
                f"{name} shape",
                f"[D] = [{d}] (one weight per head dim, shared by every head)",
                list(w.shape),
            )
    eps = check_eps(op, eps)
    grad = key.requires_grad or q_weight.requires_grad or k_weight.requires_grad
    return key._replace(requires_grad=grad), (
        q,
        k,
        q_weight,
        k_weight,
        cos,
        sin,
        position_ids,
        interleaved,
        lay,
        eps,
    )


context = _rope_context
"""The :class:`~layerzero.core.context.SelectionContext` of a qk_norm_rope cache key (a rope key, op
``"qk_norm_rope"``)."""


SPEC = OperationSpec(
    OP,
    "per-head RMSNorm of q and k, then rotary position embedding (Qwen3 q_norm/k_norm + RoPE)",
    ("q", "k", "q_weight", "k_weight", "cos", "sin"),
    "reference.qk_norm_rope",
)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float = 1e-6,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    layout: str = "BHSD",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over each head's D dims of q and of k (Zhang & Sennrich 2019; Qwen3's ``q_norm`` / ``k_norm``),
    then rotary position embeddings (RoFormer, Su et al. 2021) on the normalized heads; returns new
    ``(q, k)``.

    Equal to ``lz.rope(lz.rms_norm(q, q_weight, eps), lz.rms_norm(k, k_weight, eps), cos, sin,
    ...)`` up to rounding. Kernels: ``triton.qk_norm_rope`` (CUDA: one launch instead of three) and
    ``reference.qk_norm_rope`` keep the normalized values in float32 into the rotation and round once to the
    input dtype, as vLLM's ``fused_qk_norm_rope`` does; ``torch_native.qk_norm_rope`` (the default on CPU) is
    the two-op form (``F.rms_norm`` rounded to the input dtype, then RoPE in that dtype, as transformers'
    Qwen3 computes it).

    Shapes (B batch, Hq/Hkv heads, S tokens, D head dim, R rotary dim, even, R <= D): q ``[B, Hq, S, D]``, k
    ``[B, Hkv, S, D]`` for ``layout="BHSD"`` (``[B, S, H, D]`` for ``"BSHD"``); ``q_weight`` / ``k_weight``
    ``[D]`` in q's dtype (one weight per head dim, shared by every head); cos/sin and ``position_ids`` as
    :func:`layerzero.rope` takes them (a ``[max_pos, R]`` table with ``position_ids [B or 1, S]`` int64/int32,
    the table at positions 0..S-1, or gathered ``[B or 1, S, R]``). ``eps`` (unitless, > 0) is added to each
    head's mean square. Dims >= R are normalized but not rotated. Outputs keep q's and k's shapes and dtypes.

    Raises:
        InvalidInputError: everything :func:`layerzero.rope` refuses; weights that are not 1-D ``[D]`` tensors
            in q's dtype on q's device; eps not a finite float > 0.
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> q = torch.tensor([[[[3.0, 0.0]]]]); w = torch.ones(2)
    >>> cos = torch.zeros(1, 1, 2); sin = torch.ones(1, 1, 2)
    >>> lz.qk_norm_rope(q, q, w, w, cos, sin, eps=1e-12)[0]  # normalized to rms 1, then rotated by 90 degrees
    tensor([[[[0.0000, 1.4142]]]])
    """
    # torch.compile / torch.export: one custom-op node (no backward formula: calls with gradients trace as
    # Python)
    if (is_dynamo_compiling() or is_exporting()) and inference_only(q, k, q_weight, k_weight, cos, sin):
        return traced("qk_norm_rope")(
            q, k, q_weight, k_weight, cos, sin, eps, position_ids, interleaved, layout
        )
    hot_key = _exact_key(q, k, q_weight, k_weight, cos, sin, eps, position_ids, interleaved, layout)
    plan = None if hot_key is None else RUNTIME.cache.hot.get(hot_key)
    if (
        plan is not None
    ):  # these exact facts passed every check, but position values (CPU: per call, as lz.rope)
        if position_ids is not None:
            check_positions(OP, position_ids, cos.shape[0])
        args = (q, k, q_weight, k_weight, cos, sin, position_ids, interleaved, _LAYOUTS[layout], eps)
        if (
            OBSERVERS.none
        ):  # the plan called here, as lz.rope does (core/observers.py says when that is allowed)
            try:
                return plan.call(*args)
            except Exception as exc:  # noqa: BLE001 - recorded, then retried or re-raised as run_hot does
                return RUNTIME.hot_failure(plan, exc, args)
        out = RUNTIME.run_hot(hot_key, args)  # observed (telemetry, lz.trace, lz.dry_run): counted there
        if out is not MISS:
            return out
    key, args = prepare(
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
    return RUNTIME.run(key, context, args, hot_key)


def _exact_key(
    q: Any,
    k: Any,
    q_weight: Any,
    k_weight: Any,
    cos: Any,
    sin: Any,
    eps: Any,
    position_ids: Any,
    interleaved: Any,
    layout: Any,
) -> tuple[Any, ...] | None:
    """The exact key of a call (``Runtime.run_hot``): ``lz.rope``'s exact key of (q, k, cos, sin,
    position_ids, interleaved, layout) with both weights' dtype, shape and device and ``eps`` as given; only
    calls that passed every check of :func:`prepare` file it. None (the full path) where rope's is None, for
    weights that are not plain tensors on q's device, and for an ``eps`` that is not a float."""
    if eps.__class__ is not float or q_weight.__class__ is not _TENSOR or k_weight.__class__ is not _TENSOR:
        return None
    rope_key = _rope_exact_key(q, k, cos, sin, position_ids, interleaved, layout)
    if rope_key is None or exact_device(q, q_weight, k_weight) is None:
        return None
    return (
        OP,
        rope_key,
        q_weight.dtype,
        q_weight.shape,
        k_weight.dtype,
        k_weight.shape,
        eps,
        is_grad_enabled() and (q_weight.requires_grad or k_weight.requires_grad),
    )


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        qk_norm_rope,
        prepare,
        context,
        kernel_args=(
            "q",
            "k",
            "q_weight",
            "k_weight",
            "cos",
            "sin",
            "position_ids",
            "interleaved",
            "layout",
            "eps",
        ),
        custom_ops=("qk_norm_rope",),
    ),
)
