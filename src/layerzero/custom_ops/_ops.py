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
:mod:`layerzero.custom_ops._paged`, the others by family in :mod:`._linear_norm` (dense layers, norms,
gated MLPs, MoE), :mod:`._attention` (attention, RoPE), :mod:`._sampling` (the sampling step) and
:mod:`._quant` (quantized weights). This module is the one :func:`layerzero.custom_ops.traced` looks a wrapper
up in: it imports them all (registering every op, then the backward formulas of :mod:`._grad`) and
re-exports every wrapper in ``__all__``.
"""

from __future__ import annotations

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

from . import _grad
from ._attention import attention, qk_norm_rope, rope
from ._common import NS
from ._linear_norm import (
    embedding,
    fused_add_rms_norm,
    fused_moe,
    geglu,
    layer_norm,
    linear,
    linear_cross_entropy,
    reglu,
    rms_norm,
    rms_norm_linear,
    swiglu,
    swiglu_linear,
)
from ._paged import (
    merge_attention_states,
    paged_attention,
    paged_attention_lse,
    qk_norm_rope_cache,
    reshape_and_cache,
    rope_paged_attention,
)
from ._quant import (  # noqa: F401 - _qt_args re-exported (tests/integration/test_torch_compile_ops.py)
    _qt_args,
    dequantize,
    fp8_linear,
    quantize,
    quantized_linear,
)
from ._sampling import apply_penalties, sample, sample_greedy, sample_topk, sample_topp

_grad.register(NS)  # the backward formulas, once every op above is registered
