"""``lz.fused_moe``: the expert half of a sparse mixture-of-experts MLP with SwiGLU experts (routing done)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.context import SelectionContext, bucket
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    FLOAT_DTYPES,
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    fail,
    inference_only,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
)

OP = "fused_moe"
ID_DTYPES = (torch.int32, torch.int64)


class MoEKey(NamedTuple):
    """The selection-cache key of one ``lz.fused_moe`` call: tokens T bucketed to the next power of two
    (``batch``), hidden size H, intermediate size I (per expert), experts E and top_k K exact;
    ``capture``/``scope`` close every op's key (see ``ops.attention.AttentionKey``). The dtype of ``topk_ids``
    (int32/int64) is left out: every kernel takes both."""

    op: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    contiguous: bool
    requires_grad: bool
    deterministic: bool
    capture: bool
    scope: tuple[Any, ...]


def _fast_ok(x: Any, w13: Any, w2: Any, topk_weights: Any, topk_ids: Any) -> bool:
    """The common case in a few attribute reads: shapes, dtypes and devices all agree (values are checked
    apart)."""
    try:
        dt, dev = x.dtype, x.device
        t, h = x.shape
        e, two_i, h13 = w13.shape
        i = two_i // 2
        return (
            dt in FLOAT_DTYPES
            and h > 0
            and e > 0
            and i > 0
            and two_i == 2 * i
            and h13 == h
            and w2.shape == (e, h, i)
            and topk_ids.dim() == 2
            and 0 < topk_ids.shape[1]
            and topk_ids.shape[0] == t
            and topk_weights.shape == topk_ids.shape
            and w13.dtype == dt
            and w2.dtype == dt
            and topk_weights.dtype == torch.float32
            and topk_ids.dtype in ID_DTYPES
            and w13.device == dev
            and w2.device == dev
            and topk_weights.device == dev
            and topk_ids.device == dev
        )
    except (AttributeError, ValueError, TypeError):
        return False


def prepare(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.fused_moe`` inputs; return (cache key, canonical kernel args
    ``(x, w13, w2, topk_weights, topk_ids)``).

    Raises:
        InvalidInputError: see :func:`fused_moe`.
    """
    if not _fast_ok(x, w13, w2, topk_weights, topk_ids):
        _validate(x, w13, w2, topk_weights, topk_ids)
    e = w13.shape[0]
    if topk_ids.device.type == "cpu" and topk_ids.numel():  # a CUDA check would sync the stream: CPU only
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi > e:
            raise fail(
                OP,
                "topk_ids values",
                f"expert ids in [0, {e}) (E = w13.shape[0]), or E for a slot with no expert here",
                f"values in [{lo}, {hi}]",
                "Pass the router's top-k indices (torch.topk(probs, k).indices) over this layer's experts.",
            )
    grad = is_grad_enabled() and (
        x.requires_grad or w13.requires_grad or w2.requires_grad or topk_weights.requires_grad
    )
    contiguous = (
        x.is_contiguous()
        and w13.is_contiguous()
        and w2.is_contiguous()
        and topk_weights.is_contiguous()
        and topk_ids.is_contiguous()
    )
    layers = scope_layers()
    # the NamedTuple's own constructor: TorchDynamo mis-traces tuple.__new__(MoEKey, ...) under torch.compile
    key = MoEKey(
        OP,
        x.device,
        x.dtype,
        bucket(x.shape[0]),
        x.shape[1],
        w2.shape[2],
        e,
        topk_ids.shape[1],
        contiguous,
        grad,
        deterministic_enabled(),
        x.is_cuda and stream_capturing(),
        scope_token_of(layers) if layers else (),
    )
    return key, (x, w13, w2, topk_weights, topk_ids)


def _validate(x: Any, w13: Any, w2: Any, topk_weights: Any, topk_ids: Any) -> None:
    """The slow path: raise the typed error that says what is wrong (only reached when the fast check
    failed)."""
    check_tensor(OP, "x", x, 2)
    t, h = x.shape
    if h == 0:
        raise fail(OP, "hidden size (x.shape[1])", ">= 1", 0)
    check_tensor(OP, "w13", w13, 3)
    check_same(OP, "x", x, "w13", w13)
    e, two_i, h13 = w13.shape
    if e == 0 or two_i == 0 or two_i % 2:
        raise fail(
            OP,
            "w13 shape",
            "[E, 2I, H] with E >= 1 and an even, non-zero 2I (gate rows, then up rows)",
            list(w13.shape),
            "Stack each expert's [gate_proj; up_proj] weights: torch.cat((gate, up), 0).",
        )
    if h13 != h:
        raise fail(
            OP,
            "w13 shape",
            f"[E, 2I, H] with H = x.shape[1] = {h}",
            list(w13.shape),
            "w13[e] is [gate_proj; up_proj] of expert e, as nn.Linear weights [out, in].",
        )
    i = two_i // 2
    check_tensor(OP, "w2", w2, 3)
    check_same(OP, "x", x, "w2", w2)
    if tuple(w2.shape) != (e, h, i):
        raise fail(
            OP,
            "w2 shape",
            f"[E, H, I] = {[e, h, i]} (from w13 [E, 2I, H] and x [T, H])",
            list(w2.shape),
            "w2[e] is down_proj of expert e as an nn.Linear weight [H, I].",
        )
    for name, ids in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(ids, torch.Tensor):
            raise fail(OP, name, "a torch.Tensor", type(ids).__name__)
        check_same(OP, "x", x, name, ids, dtype=False)
        if ids.dim() != 2 or ids.shape[0] != t:
            raise fail(
                OP,
                f"{name} shape",
                f"[T, K] with T = x.shape[0] = {t}",
                list(ids.shape),
                "Pass one row of top-k router outputs per token of x.",
            )
    if topk_ids.dtype not in ID_DTYPES:
        raise fail(OP, "topk_ids.dtype", "int32 or int64", topk_ids.dtype, "Cast it with topk_ids.long().")
    if topk_weights.dtype != torch.float32:
        raise fail(
            OP,
            "topk_weights.dtype",
            "torch.float32 (router weights are kept in float32)",
            topk_weights.dtype,
            "Cast it with topk_weights.float().",
        )
    k = topk_ids.shape[1]
    if topk_weights.shape[1] != k:
        raise fail(
            OP, "topk_weights shape", f"topk_ids' shape {list(topk_ids.shape)}", list(topk_weights.shape)
        )
    if k < 1:
        raise fail(OP, "top_k (topk_ids.shape[1])", ">= 1", k)


def context(key: MoEKey) -> SelectionContext:
    """The :class:`SelectionContext` of a fused_moe cache key."""
    return SelectionContext(
        op=OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.batch,
        hidden_size=key.hidden_size,
        intermediate_size=key.intermediate_size,
        num_experts=key.num_experts,
        top_k=key.top_k,
        contiguous=key.contiguous,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
    )


SPEC = OperationSpec(
    OP,
    "sparse MoE experts: sum_k w_k * SwiGLU-expert_{id_k}(x)",
    ("x", "w13", "w2", "topk_weights", "topk_ids"),
    "reference.fused_moe",
)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The experts of a sparse mixture-of-experts MLP with SwiGLU experts, routing already done (Shazeer et
    al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer"; Mixtral,
    Jiang et al. 2024; Qwen3-MoE). The same contract as vLLM's ``fused_experts`` and SGLang's fused MoE: for
    each token t::

        out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
        e = topk_ids[t, k]

    Shapes (T tokens, H hidden size, E experts, I intermediate size per expert, K experts per token): x
    ``[T, H]``; w13 ``[E, 2I, H]`` (per expert the gate rows 0..I-1 then the up rows I..2I-1, as nn.Linear
    weights: transformers 5's ``gate_up_proj``, vLLM's ``w13``); w2 ``[E, H, I]`` (``down_proj``);
    topk_weights ``[T, K]`` float32 (the router's weights, already softmaxed and renormalised by the caller);
    topk_ids ``[T, K]`` int32/int64 in ``[0, E]``: ``E`` marks a slot with no expert here, which adds nothing
    (expert parallelism: a token's slots on other ranks' experts; vLLM's ``expert_map`` -1), so K may exceed
    E. Returns ``[T, H]`` in x's dtype, a new tensor (``[0, H]`` when T = 0).

    dtype: x, w13 and w2 equal, float16/bfloat16/float32 (float64 too, by the reference kernel). Sums over k
    are accumulated in float32; kernels may round the SwiGLU output ``h`` to x's dtype before the down
    projection (as vLLM does), the reference does not. Any strides. Values of topk_ids are checked for CPU
    tensors only (a check of a CUDA tensor would synchronize the stream); an id out of range on a GPU is
    undefined behaviour.

    Raises:
        InvalidInputError: a non-tensor input; x not 2-D or with H = 0; w13 not ``[E, 2I, H]`` with E >= 1 and
            an even 2I >= 2; w2 not ``[E, H, I]``; x/w13/w2 dtypes differing or not float; topk_weights not
            float32 or topk_ids not int32/int64; topk shapes not ``[T, K]`` with K >= 1; devices differing;
            (CPU) topk_ids values outside ``[0, E]``.

    >>> import torch, layerzero as lz
    >>> x = torch.ones(3, 4); w13 = torch.ones(2, 6, 4); w2 = torch.ones(2, 4, 3)
    >>> ids = torch.tensor([[0, 1], [1, 0], [1, 1]]); weights = torch.full((3, 2), 0.5)
    >>> out = lz.fused_moe(x, w13, w2, weights, ids)
    >>> # each expert gives I * silu(4) * 4 = 3 * 3.928 * 4; the weights sum to 1
    >>> out.shape, round(out[0, 0].item(), 2)
    (torch.Size([3, 4]), 47.14)
    """
    if (is_dynamo_compiling() or is_exporting()) and inference_only(x, w13, w2, topk_weights):
        return traced("fused_moe")(x, w13, w2, topk_weights, topk_ids)
    key, args = prepare(x, w13, w2, topk_weights, topk_ids)
    return RUNTIME.run(key, context, args)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(SPEC, fused_moe, prepare, context, custom_ops=("fused_moe",)),
)
