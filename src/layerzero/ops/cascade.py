"""Cascade (shared-prefix) attention's two building blocks: ``lz.paged_attention(..., return_lse=True)`` (op
``paged_attention_lse``: the output and its log-sum-exp) and ``lz.merge_attention_states`` (combine two
partial attentions over disjoint key sets into the attention over their union).

Attention over keys ``K_a ∪ K_b`` is the softmax-weighted combination of the attention over ``K_a`` and over
``K_b``, each weighted by its share of the softmax mass ``exp(lse)``: that is how FlashDecoding merges its
splits, and how cascade attention (FlashInfer's ``MultiLevelCascadeAttentionWrapper`` and ``merge_state``, Ye
et al. 2024, "Cascade Inference"; vLLM's ``merge_attn_states``; SGLang's ``merge_state``) reads a prefix
shared by many sequences ONCE per group of queries instead of once per sequence. See docs/paged_attention.md
("Cascade attention").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext, bucket
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import check_same, check_tensor, device_spec, fail, flags, inference_only, scope_token
from .paged import LSE_OP, LSE_SPEC, context_lse, paged_attention_lse, prepare_lse  # noqa: F401 - re-exported

MERGE_OP = "merge_attention_states"
LSE_DTYPES = frozenset({torch.float32, torch.float64})


# ---------------------------------------------------------------------------------- merge_attention_states
class MergeKey(NamedTuple):
    """The selection-cache key of one ``lz.merge_attention_states`` call (``num_tokens`` bucketed; ``dtype``
    the outputs', ``lse_dtype`` the log-sum-exps'); ``capture``/``scope`` close every op's key."""

    op: str
    device: torch.device
    dtype: torch.dtype
    lse_dtype: torch.dtype
    num_tokens: int
    num_heads: int
    head_dim: int
    stride_last_1: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def prepare_merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[MergeKey, tuple[Any, ...]]:
    """Validate ``lz.merge_attention_states`` inputs; return (cache key, canonical kernel args
    ``(out_a, lse_a, out_b, lse_b)``)."""
    check_tensor(MERGE_OP, "out_a", out_a, 3)
    check_tensor(MERGE_OP, "out_b", out_b, 3)
    check_same(MERGE_OP, "out_a", out_a, "out_b", out_b)
    if out_a.shape != out_b.shape:
        raise fail(MERGE_OP, "out_b shape", f"out_a's [T, H, D] = {list(out_a.shape)}", list(out_b.shape))
    t, h, d = out_a.shape
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if not isinstance(lse, torch.Tensor):
            raise fail(MERGE_OP, name, "a float32 tensor [T, H]", type(lse).__name__)
        if lse.dtype not in LSE_DTYPES:
            raise fail(
                MERGE_OP,
                f"{name}.dtype",
                "float32 (float64 for float64 oracles)",
                lse.dtype,
                "Pass the lse that lz.paged_attention(..., return_lse=True) returned.",
            )
        check_same(MERGE_OP, "out_a", out_a, name, lse, dtype=False)
        if tuple(lse.shape) != (t, h):
            raise fail(
                MERGE_OP, f"{name} shape", f"[T, H] = [{t}, {h}] (out_a's first two dims)", list(lse.shape)
            )
    if lse_a.dtype != lse_b.dtype:
        raise fail(MERGE_OP, "lse_b.dtype", f"{lse_a.dtype} (like lse_a)", lse_b.dtype)
    if lse_a.dtype == torch.float64 and out_a.dtype != torch.float64:
        raise fail(
            MERGE_OP,
            "lse dtype",
            f"float32 for {out_a.dtype} outputs (float64 only with float64 outputs)",
            lse_a.dtype,
            "Pass lse.float().",
        )
    grad, det, capture, stride = flags(out_a, lse_a, out_b, lse_b)
    key = MergeKey(
        MERGE_OP,
        out_a.device,
        out_a.dtype,
        lse_a.dtype,
        bucket(t),
        h,
        d,
        stride,
        grad,
        det,
        capture,
        scope_token(),
    )
    return key, (out_a, lse_a, out_b, lse_b)


def context_merge(key: MergeKey) -> SelectionContext:
    """The :class:`SelectionContext` of a merge key (``batch`` = num_tokens bucket, heads and head dim
    exact)."""
    return SelectionContext(
        op=MERGE_OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.num_tokens,
        num_heads_q=key.num_heads,
        num_heads_kv=key.num_heads,
        head_dim=key.head_dim,
        head_dim_v=key.head_dim,
        stride_last_1=key.stride_last_1,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


MERGE_SPEC = OperationSpec(
    MERGE_OP,
    "combine two partial attentions over disjoint key sets (out, lse) into one",
    ("out_a", "lse_a", "out_b", "lse_b"),
    "reference.merge_attention_states",
)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets A and B into the attention over ``A ∪ B``
    (FlashInfer's ``merge_state``, vLLM's ``merge_attn_states``; the combination step of FlashDecoding and of
    cascade attention, Ye et al. 2024):

    ``m = max(lse_a, lse_b)``, ``w_a = exp(lse_a - m)``, ``w_b = exp(lse_b - m)``, ``out = (w_a * out_a +
    w_b * out_b) / (w_a + w_b)``, ``lse = m + log(w_a + w_b)``, in float32 (float64 for float64 inputs). A row
    where both lse are -inf (no key in either set) gets out 0 and lse -inf; a row where one is -inf takes the
    other state unchanged.

    Shapes (T rows, e.g. query tokens, H heads, D head dim): ``out_a``, ``out_b`` ``[T, H, D]``
    float16/bfloat16/ float32/float64, same dtype and device; ``lse_a``, ``lse_b`` ``[T, H]`` float32 (float64
    allowed with float64 outputs), natural log, as :func:`lz.paged_attention(..., return_lse=True)
    <layerzero.paged_attention>` returns them. Returns ``(out [T, H, D] in out_a's dtype, lse [T, H] in
    lse_a's dtype)``, new tensors.

    Raises:
        InvalidInputError: a non-float or non-3-D output, shapes, dtypes or devices that disagree, an lse that
            is not float32/float64 ``[T, H]``.

    >>> import torch, layerzero as lz
    >>> o, lse = lz.merge_attention_states(torch.ones(1, 1, 2), torch.zeros(1, 1), torch.zeros(1, 1, 2),
    ...                                    torch.zeros(1, 1))
    >>> o.tolist(), round(lse.item(), 4)
    ([[[0.5, 0.5]]], 0.6931)
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(out_a, out_b):
        return traced("merge_attention_states")(out_a, lse_a, out_b, lse_b)
    key, args = prepare_merge(out_a, lse_a, out_b, lse_b)
    return RUNTIME.run(key, context_merge, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        MERGE_SPEC,
        merge_attention_states,
        prepare_merge,
        context_merge,
        custom_ops=("merge_attention_states",),
    ),
)
