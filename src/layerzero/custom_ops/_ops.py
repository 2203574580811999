"""LayerZero ops as ``torch.library`` custom ops (namespace ``layerzero``): what ``torch.compile`` and
``torch.export`` see.

Under TorchDynamo, ``lz.attention`` / ``lz.rms_norm`` (plain and with ``residual``) / ``lz.layer_norm`` /
``lz.rope`` / ``lz.qk_norm_rope``, ``lz.rms_norm_linear`` and ``lz.swiglu_linear`` (inference calls: no
backward formula) / ``lz.swiglu`` / ``lz.geglu`` / ``lz.reglu`` / ``lz.linear`` / ``lz.embedding`` /
``lz.linear_cross_entropy`` call ``torch.ops.layerzero.<op>`` (through :func:`layerzero.custom_ops.traced`,
which imports this module then, at trace time, and so registers the ops; eager code never imports it): one
opaque node per call with a fake (meta) implementation for shapes and dtypes, so a compiled model has no graph
breaks at lz ops, and selection happens when the compiled graph first runs the op for real (the op's
implementation is the eager ``lz.<op>``: validation, cache, kernel), never while tracing. ``torch.export``
graphs hold ``torch.ops.layerzero.<op>.default`` nodes.

Each function here takes and returns what the ``lz`` op it names does (shapes, dtypes, units, the typed errors
of its eager validation, the paper or library it follows: see that op's docstring); the fake implementations
give the output shapes and dtypes, contiguous, and every real implementation returns exactly that: fresh
contiguous tensors that share no memory with the op's inputs or with each other (:func:`_owned`), as
Inductor's memory planning assumes (it frees, reuses and writes in place into custom-op outputs; a stride that
differs from the fake's fails its ``assert_size_stride``).
``tests/integration/test_torch_compile_ops.py`` runs ``torch.library.opcheck`` on every op, with strided
inputs too.

``lz.dequantize``, ``lz.quantized_linear`` and ``lz.fp8_linear`` take a ``QuantizedTensor`` (a NamedTuple, not
a tensor): their ops take its fields (codes, scales, zero point, global scale as tensors; format, shape,
dtype, axis, group size as arguments) and rebuild it inside, so a compiled model with quantized linears has no
graph breaks there either. ``lz.quantize``'s op returns the four tensors (an absent zero point or global scale
as an empty tensor) and the wrapper builds the QuantizedTensor.

Also ``lz.paged_attention``, ``lz.reshape_and_cache``, ``lz.qk_norm_rope_cache`` and
``lz.rope_paged_attention`` (the last three mutate ``kv_cache``; the last two for inference calls only),
``lz.fused_moe``, ``lz.apply_penalties``, ``lz.sample_greedy``, and ``lz.sample`` / ``lz.sample_topk`` /
``lz.sample_topp`` without a ``generator`` (custom ops cannot take a ``torch.Generator``: calls with one are
traced as Python, as before). ``lz.paged_attention`` and ``lz.reshape_and_cache`` with ``k_scale`` /
``v_scale`` (a quantized cache's scales) are traced as Python too. The paged KV-cache ops are defined in
:mod:`layerzero.custom_ops._paged` (imported and re-exported at the end of this module).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = [
    "apply_penalties",
    "attention",
    "dequantize",
    "embedding",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "geglu",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "merge_attention_states",
    "paged_attention",
    "paged_attention_lse",
    "qk_norm_rope",
    "qk_norm_rope_cache",
    "quantize",
    "quantized_linear",
    "reglu",
    "reshape_and_cache",
    "rms_norm",
    "rms_norm_linear",
    "rope",
    "rope_paged_attention",
    "sample",
    "sample_greedy",
    "sample_topk",
    "sample_topp",
    "swiglu",
    "swiglu_linear",
]

from ._common import NS, _layout_str, _owned, eager


# ------------------------------------------------------------------------------------------ linear, embedding
@torch.library.custom_op(f"{NS}::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    return _owned(eager("linear")(x, weight, bias), x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{NS}::embedding", mutates_args=())
def embedding(input_ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:  # noqa: UP045
    return _owned(eager("embedding")(input_ids, weight, padding_idx=padding_idx), input_ids, weight)


@embedding.register_fake
def _(input_ids, weight, padding_idx):
    return weight.new_empty((*input_ids.shape, weight.shape[1]))


@torch.library.custom_op(f"{NS}::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,  # noqa: UP045
    label_smoothing: float,
    softcap: Optional[float],
) -> torch.Tensor:  # noqa: UP045
    out = eager("linear_cross_entropy")(
        hidden,
        weight,
        target,
        bias=bias,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        softcap=softcap,
    )
    return _owned(out, hidden, weight, target, bias)


@linear_cross_entropy.register_fake
def _(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    dtype = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    return hidden.new_empty(tuple(target.shape) if reduction == "none" else (), dtype=dtype)


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


# -------------------------------------------------------------------------------------------- norms
@torch.library.custom_op(f"{NS}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``lz.rms_norm(x, weight, eps)`` as a custom op."""
    return _owned(eager("rms_norm")(x, weight, eps), x, weight)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{NS}::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lz.rms_norm(x, weight, eps, residual=residual)`` -> ``(y, x + residual)`` as a custom op."""
    y, h = eager("rms_norm")(x, weight, eps, residual=residual)
    y = _owned(y, x, weight, residual)
    return y, _owned(h, x, weight, residual, y)


@fused_add_rms_norm.register_fake
def _(x, weight, eps, residual):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op(f"{NS}::layer_norm", mutates_args=())
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    eps: float,
) -> torch.Tensor:
    """``lz.layer_norm`` as a custom op."""
    return _owned(eager("layer_norm")(x, weight, bias, eps), x, weight, bias)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return x.new_empty(x.shape)


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


@torch.library.custom_op(f"{NS}::rms_norm_linear", mutates_args=())
def _rms_norm_linear(
    x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:  # noqa: UP045
    return _owned(
        eager("rms_norm_linear")(x, norm_weight, weight, bias, eps=eps), x, norm_weight, weight, bias
    )


@_rms_norm_linear.register_fake
def _(x, norm_weight, weight, bias, eps):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{NS}::fused_add_rms_norm_linear", mutates_args=())
def _fused_add_rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,  # noqa: UP045
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, h = eager("rms_norm_linear")(x, norm_weight, weight, bias, eps=eps, residual=residual)
    inputs = (x, norm_weight, weight, bias, residual)
    y = _owned(y, *inputs)
    return y, _owned(h, *inputs, y)


@_fused_add_rms_norm_linear.register_fake
def _(x, norm_weight, weight, bias, eps, residual):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty(x.shape)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.layerzero.rms_norm_linear`` (or ``fused_add_rms_norm_linear`` with a residual) with
    ``lz.rms_norm_linear``'s arguments."""
    if residual is None:
        return _rms_norm_linear(x, norm_weight, weight, bias, float(eps))
    return _fused_add_rms_norm_linear(x, norm_weight, weight, bias, float(eps), residual)


# -------------------------------------------------------------------------------------------- gated MLPs
@torch.library.custom_op(f"{NS}::swiglu_linear", mutates_args=())
def swiglu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:  # noqa: UP045
    """``lz.swiglu_linear`` as a custom op."""
    return _owned(eager("swiglu_linear")(gate, up, weight, bias), gate, up, weight, bias)


@swiglu_linear.register_fake
def _(gate, up, weight, bias):
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{NS}::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``lz.swiglu`` as a custom op."""
    return _owned(eager("swiglu")(gate, up), gate, up)


@torch.library.custom_op(f"{NS}::geglu", mutates_args=())
def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """``lz.geglu`` as a custom op."""
    return _owned(eager("geglu")(gate, up, approximate=approximate), gate, up)


@torch.library.custom_op(f"{NS}::reglu", mutates_args=())
def reglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``lz.reglu`` as a custom op."""
    return _owned(eager("reglu")(gate, up), gate, up)


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@geglu.register_fake
def _(gate, up, approximate):
    return gate.new_empty(gate.shape)


@reglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


# -------------------------------------------------------------------------------------------- MoE
@torch.library.custom_op(f"{NS}::fused_moe", mutates_args=())
def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``lz.fused_moe`` as a custom op."""
    return _owned(eager("fused_moe")(x, w13, w2, topk_weights, topk_ids), x, w13, w2, topk_weights, topk_ids)


@fused_moe.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return x.new_empty(x.shape)


# -------------------------------------------------------------------------------------------- sampling step
@torch.library.custom_op(f"{NS}::sample", mutates_args=())
def sample(
    logits: torch.Tensor,
    temperature: Optional[torch.Tensor],
    top_k: Optional[torch.Tensor],  # noqa: UP045
    top_p: Optional[torch.Tensor],
    min_p: Optional[torch.Tensor],  # noqa: UP045
    seeds: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
) -> torch.Tensor:  # noqa: UP045
    """``lz.sample`` (no ``generator``: the global RNG for unseeded rows) as a custom op."""
    out = eager("sample")(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, offsets=offsets
    )
    return _owned(out, logits, temperature, top_k, top_p, min_p, seeds, offsets)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op(f"{NS}::sample_topk", mutates_args=())
def sample_topk(logits: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """``lz.sample_topk`` without a ``generator`` (the global RNG) as a custom op."""
    return _owned(eager("sample_topk")(logits, k, temperature=temperature), logits)


@torch.library.custom_op(f"{NS}::sample_topp", mutates_args=())
def sample_topp(logits: torch.Tensor, p: float, temperature: float) -> torch.Tensor:
    """``lz.sample_topp`` without a ``generator`` (the global RNG) as a custom op."""
    return _owned(eager("sample_topp")(logits, p, temperature=temperature), logits)


@sample_topk.register_fake
def _(logits, k, temperature):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@sample_topp.register_fake
def _(logits, p, temperature):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op(f"{NS}::sample_greedy", mutates_args=())
def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """``lz.sample_greedy`` as a custom op."""
    return _owned(eager("sample_greedy")(logits), logits)


@sample_greedy.register_fake
def _(logits):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@torch.library.custom_op(f"{NS}::apply_penalties", mutates_args=())
def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalty: Optional[torch.Tensor],
    presence_penalty: Optional[torch.Tensor],  # noqa: UP045
    frequency_penalty: Optional[torch.Tensor],
) -> torch.Tensor:  # noqa: UP045
    """``lz.apply_penalties`` as a custom op."""
    out = eager("apply_penalties")(
        logits,
        prompt_token_ids,
        output_token_ids,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    return _owned(
        out,
        logits,
        prompt_token_ids,
        output_token_ids,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
    )


@apply_penalties.register_fake
def _(logits, prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty, frequency_penalty):
    return logits.new_empty(logits.shape)


# ------------------------------------------------------------------------------------------ quantized weights
def _group_arg(group_size: Any) -> list[int] | None:
    """A QuantizedTensor's ``group_size`` (None, ``g`` or ``(bm, bk)``) as a custom-op argument: None, ``[g]``
    or ``[bm, bk]``."""
    if group_size is None:
        return None
    return [int(group_size)] if isinstance(group_size, int) else [int(v) for v in group_size]


def _group_of(group_size: list[int] | None) -> Any:
    """The inverse of :func:`_group_arg`."""
    if group_size is None:
        return None
    return group_size[0] if len(group_size) == 1 else tuple(group_size)


def _qt_args(qt: Any) -> tuple[Any, ...]:
    """A ``QuantizedTensor``'s fields as custom-op arguments (group size by :func:`_group_arg`)."""
    return (
        qt.data,
        qt.scale,
        qt.zero_point,
        qt.global_scale,
        qt.format.value,
        [int(n) for n in qt.shape],
        qt.dtype,
        qt.axis,
        _group_arg(qt.group_size),
    )


def _qt(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    global_scale: torch.Tensor | None,
    fmt: str,
    shape: list[int],
    dtype: torch.dtype,
    axis: int | None,
    group_size: list[int] | None,
) -> Any:
    """The ``QuantizedTensor`` :func:`_qt_args` took apart (validated by the eager op it is passed to)."""
    from layerzero.core.quant_format import QuantFormat, QuantizedTensor

    return QuantizedTensor(
        data,
        scale,
        zero_point,
        global_scale,
        QuantFormat(fmt),
        torch.Size(shape),
        dtype,
        axis,
        _group_of(group_size),
    )


@torch.library.custom_op(f"{NS}::dequantize", mutates_args=())
def _dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero_point: Optional[torch.Tensor],  # noqa: UP045
    global_scale: Optional[torch.Tensor],
    fmt: str,
    shape: list[int],
    dtype: torch.dtype,  # noqa: UP045
    axis: Optional[int],
    group_size: Optional[list[int]],
) -> torch.Tensor:  # noqa: UP045
    out = eager("dequantize")(_qt(data, scale, zero_point, global_scale, fmt, shape, dtype, axis, group_size))
    return _owned(out, data, scale, zero_point, global_scale)


@_dequantize.register_fake
def _(data, scale, zero_point, global_scale, fmt, shape, dtype, axis, group_size):
    return data.new_empty(shape, dtype=dtype)


def dequantize(qt: Any) -> torch.Tensor:
    """``torch.ops.layerzero.dequantize`` with ``lz.dequantize``'s argument (a ``QuantizedTensor``)."""
    return _dequantize(*_qt_args(qt))


def _qt_linear_op(name: str) -> Any:
    """The custom op ``layerzero::<name>`` of a projection with a ``QuantizedTensor`` weight
    (``lz.quantized_linear``, ``lz.fp8_linear``): x, the weight's fields (:func:`_qt_args`) and bias; output
    ``[..., N]`` like x."""

    def impl(
        x: torch.Tensor,
        data: torch.Tensor,
        scale: torch.Tensor,
        zero_point: Optional[torch.Tensor],
        global_scale: Optional[torch.Tensor],  # noqa: UP045
        fmt: str,
        shape: list[int],
        dtype: torch.dtype,
        axis: Optional[int],  # noqa: UP045
        group_size: Optional[list[int]],
        bias: Optional[torch.Tensor],
    ) -> torch.Tensor:  # noqa: UP045
        qt = _qt(data, scale, zero_point, global_scale, fmt, shape, dtype, axis, group_size)
        return _owned(eager(name)(x, qt, bias), x, data, scale, zero_point, global_scale, bias)

    impl.__name__ = impl.__qualname__ = f"_{name}"
    op = torch.library.custom_op(f"{NS}::{name}", impl, mutates_args=())

    @op.register_fake
    def _(x, data, scale, zero_point, global_scale, fmt, shape, dtype, axis, group_size, bias):
        return x.new_empty((*x.shape[:-1], shape[0]))

    return op


_quantized_linear = _qt_linear_op("quantized_linear")
_fp8_linear = _qt_linear_op("fp8_linear")


def quantized_linear(x: torch.Tensor, qt: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.ops.layerzero.quantized_linear`` with ``lz.quantized_linear``'s arguments."""
    return _quantized_linear(x, *_qt_args(qt), bias)


def fp8_linear(x: torch.Tensor, qt: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.ops.layerzero.fp8_linear`` with ``lz.fp8_linear``'s arguments."""
    return _fp8_linear(x, *_qt_args(qt), bias)


@torch.library.custom_op(f"{NS}::quantize", mutates_args=())
def _quantize(
    x: torch.Tensor,
    fmt: str,
    axis: Optional[int],
    group_size: Optional[list[int]],  # noqa: UP045
    check_finite: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    qt = eager("quantize")(x, fmt, axis=axis, group_size=_group_of(group_size), check_finite=check_finite)
    zp = qt.zero_point if qt.zero_point is not None else x.new_empty(0, dtype=torch.uint8)
    gs = qt.global_scale if qt.global_scale is not None else x.new_empty(0, dtype=torch.float32)
    outs: list[torch.Tensor] = []
    for t in (qt.data, qt.scale, zp, gs):
        outs.append(_owned(t, x, *outs))
    return tuple(outs)


@_quantize.register_fake
def _(x, fmt, axis, group_size, check_finite):
    from layerzero.core.quant_format import QuantFormat, storage_layout

    data, scale, zp, gs = storage_layout(QuantFormat(fmt), tuple(x.shape), axis, _group_of(group_size))
    return (
        x.new_empty(data[1], dtype=data[0]),
        x.new_empty(scale[1], dtype=scale[0]),
        x.new_empty(zp[1] if zp else 0, dtype=torch.uint8),
        x.new_empty(gs[1] if gs else 0, dtype=torch.float32),
    )


def quantize(x: torch.Tensor, fmt: Any, axis: int | None, group_size: Any, check_finite: bool) -> Any:
    """``torch.ops.layerzero.quantize`` with ``lz.quantize``'s arguments (``fmt`` a QuantFormat; ``axis`` and
    ``group_size`` normalized); returns the QuantizedTensor."""
    from layerzero.core.quant_format import QuantFormat, QuantizedTensor

    data, scale, zp, gs = _quantize(x, fmt.value, axis, _group_arg(group_size), bool(check_finite))
    return QuantizedTensor(
        data,
        scale,
        zp if fmt is QuantFormat.INT4 else None,
        gs if fmt is QuantFormat.NVFP4 else None,
        fmt,
        x.shape,
        x.dtype,
        axis,
        group_size,
    )


from . import _grad  # noqa: E402  (needs the ops above)

_grad.register(NS)


# the paged KV-cache ops (registered when this module is imported, as every op here; kept in their own file
# for size)
from ._paged import (  # noqa: E402, F401 - re-exported
    merge_attention_states,
    paged_attention,
    paged_attention_lse,
    qk_norm_rope_cache,
    reshape_and_cache,
    rope_paged_attention,
)
