"""The reference backend: plain PyTorch in float32 (float64 for float64 inputs), written for clarity.

It is the oracle of every correctness test and the last fallback of every op: its kernels have no
constraints beyond the device types PyTorch itself runs on, and policy deny/allow rules never remove them.
"""

from __future__ import annotations

import torch

from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec, KernelSpec, Layout

from . import kernels as K
from .paged import kernel_specs as paged_kernel_specs

ALL_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu"})
FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def _attention(
    q, k, v, attn_mask, is_causal, scale, dropout_p, window=None, softcap=None, alibi_slopes=None
):  # BHSD in, BHSD out
    return K.attention(
        q,
        k,
        v,
        attn_mask,
        is_causal,
        scale,
        dropout_p,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
    )


def _rms_norm(x, weight, eps, residual):
    return K.rms_norm(x, weight, eps, residual, cast_before_weight=True)


def _layer_norm(x, weight, bias, eps):
    return K.layer_norm(x, weight, bias, eps)


def _rope(q, k, cos, sin, position_ids, interleaved, layout):
    return K.rope(q, k, cos, sin, position_ids, interleaved, layout)


def _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, position_ids, interleaved, layout, eps):
    return K.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, position_ids, interleaved, layout, eps)


def _qk_norm_rope_cache(
    q, k, v, q_weight, k_weight, cos, sin, kv_cache, slot_mapping, position_ids, interleaved, kv_layout, eps
):
    """``reference.qk_norm_rope`` on ``q[None]`` / ``k[None]`` (BSHD), then ``reference.reshape_and_cache`` of
    the rotated k and v."""
    qo, ko = K.qk_norm_rope(
        q.unsqueeze(0),
        k.unsqueeze(0),
        q_weight,
        k_weight,
        cos,
        sin,
        position_ids.view(1, -1),
        interleaved,
        "BSHD",
        eps,
    )
    from .paged import reshape_and_cache

    reshape_and_cache(ko[0], v, kv_cache, slot_mapping, kv_layout)
    return qo[0], ko[0]


def _rope_paged_attention(
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
    block_tables,
    seq_lens,
    cu_seqlens_q,
    scale,
    interleaved,
    kv_layout,
    eps,
):
    """``reference.qk_norm_rope`` (``reference.rope`` without weights) on ``q[None]`` / ``k[None]`` (BSHD),
    ``reference.reshape_and_cache`` of the rotated k and v, then ``reference.paged_attention`` (causal) of the
    rotated q: ``[T, Hq, D]`` in q's dtype."""
    from .paged import paged_attention, reshape_and_cache

    pos = position_ids.view(1, -1)
    if q_weight is None:
        qo, ko = K.rope(q.unsqueeze(0), k.unsqueeze(0), cos, sin, pos, interleaved, "BSHD")
    else:
        qo, ko = K.qk_norm_rope(
            q.unsqueeze(0), k.unsqueeze(0), q_weight, k_weight, cos, sin, pos, interleaved, "BSHD", eps
        )
    reshape_and_cache(ko[0], v, kv_cache, slot_mapping, kv_layout)
    return paged_attention(qo[0], kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, True, kv_layout)


def _sample_topk(logits, k, temperature, generator):
    return K.sample_topk(logits, k, temperature, generator)


def _sample_topp(logits, p, temperature, generator):
    return K.sample_topp(logits, p, temperature, generator)


def _sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, generator):
    return K.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets, generator)


def _sample_greedy(logits):
    return K.sample_greedy(logits)


def _apply_penalties(
    logits, prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty, frequency_penalty
):
    return K.apply_penalties(
        logits, prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty, frequency_penalty
    )


def _apply_token_bitmask(logits, bitmask, indices):
    return K.apply_token_bitmask(logits, bitmask, indices)


def _swiglu(gate, up):
    return K.swiglu(gate, up)


def _geglu(gate, up, approximate):
    return K.geglu(gate, up, approximate)


def _reglu(gate, up):
    return K.reglu(gate, up)


def _fused_moe(x, w13, w2, topk_weights, topk_ids):
    return K.fused_moe(x, w13, w2, topk_weights, topk_ids)


def register(registry: KernelRegistry) -> None:
    """Add the reference backend and one kernel per op."""
    registry.add_backend(
        BackendSpec(
            "reference", None, torch.__version__, True, description="plain PyTorch float32/float64 oracle"
        )
    )
    common = dict(priority=0, device_types=ALL_DEVICES, dtypes=FLOATS, is_reference=True, deterministic=True)
    for op, fn, extra in (
        (
            "attention",
            _attention,
            {
                "layouts": frozenset({Layout.BHSD}),
                "supports_window": True,
                "supports_softcap": True,
                "supports_alibi": True,
            },
        ),
        ("rms_norm", _rms_norm, {}),
        ("layer_norm", _layer_norm, {}),
        ("rope", _rope, {"layouts": frozenset({Layout.BHSD, Layout.BSHD})}),
        ("qk_norm_rope", _qk_norm_rope, {"layouts": frozenset({Layout.BHSD, Layout.BSHD})}),
        (
            "qk_norm_rope_cache",
            _qk_norm_rope_cache,
            {"graph_safe": False},
        ),  # its cache write checks slots on host
        (
            "rope_paged_attention",
            _rope_paged_attention,
            {"graph_safe": False},
        ),  # host reads of slots and lengths
        ("sample_topk", _sample_topk, {"graph_safe": False}),
        ("sample_topp", _sample_topp, {"graph_safe": False}),
        ("sample", _sample, {"graph_safe": False}),
        ("sample_greedy", _sample_greedy, {}),  # device ops only: graph-safe
        ("apply_penalties", _apply_penalties, {"graph_safe": False}),
        ("apply_token_bitmask", _apply_token_bitmask, {"graph_safe": False, "supports_backward": False}),
        ("swiglu", _swiglu, {}),
        ("geglu", _geglu, {}),
        ("reglu", _reglu, {}),
        ("fused_moe", _fused_moe, {"graph_safe": False}),  # nonzero() per expert: a host sync
    ):
        registry.add_kernel(
            KernelSpec(
                f"reference.{op}", op, fn, description=f"reference {op} (float32 math)", **common, **extra
            )
        )
    for spec in paged_kernel_specs(common):
        registry.add_kernel(spec)
    _register_collectives(registry)
    from .linear_ce import linear_cross_entropy  # lz.linear_cross_entropy (full logits, float32 math)

    registry.add_kernel(
        KernelSpec(
            "reference.linear_cross_entropy",
            "linear_cross_entropy",
            linear_cross_entropy,
            description="reference linear_cross_entropy (full logits in float32, F.cross_entropy)",
            supports_softcap=True,
            **common,
        )
    )
    from .quantize import dequantize, quantize  # lz.quantize / lz.dequantize (float32 math, format tables)

    for op, fn in (("quantize", quantize), ("dequantize", dequantize)):
        registry.add_kernel(
            KernelSpec(
                f"reference.{op}",
                op,
                fn,
                description=f"reference {op} (format tables)",
                supports_backward=False,
                **common,
            )
        )
    from .linear import (  # lz.linear and the fused forms
        fp8_linear,
        linear,
        quantized_linear,
        rms_norm_linear,
        swiglu_linear,
    )

    for op, fn, first in (
        ("rms_norm_linear", rms_norm_linear, "reference.rms_norm"),
        ("swiglu_linear", swiglu_linear, "reference.swiglu"),
    ):
        registry.add_kernel(
            KernelSpec(
                f"reference.{op}",
                op,
                fn,
                description=f"reference {op} ({first}, then float32 accumulation, one rounding)",
                **common,
            )
        )

    registry.add_kernel(
        KernelSpec(
            "reference.linear",
            "linear",
            linear,
            description="reference linear (float32 accumulation, one rounding)",
            **common,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "reference.quantized_linear",
            "quantized_linear",
            quantized_linear,
            description="reference quantized linear (weight dequantized in float32, float32 "
            "accumulation, one rounding; differentiable in x and bias)",
            **common,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "reference.fp8_linear",
            "fp8_linear",
            fp8_linear,
            description="reference W8A8 fp8 linear (x quantized per row to e4m3, the codes' "
            "products summed in float64, one rounding)",
            **{**common, "supports_backward": False},
        )
    )
    from .embedding import embedding  # lz.embedding (index_select)

    registry.add_kernel(
        KernelSpec(
            "reference.embedding",
            "embedding",
            embedding,
            description="reference embedding (weight.index_select)",
            **common,
        )
    )


def _register_collectives(registry: KernelRegistry) -> None:
    """``reference.all_reduce`` / ``all_gather`` / ``reduce_scatter`` / ``all_to_all``: torch.distributed's
    plainest calls on any transport (not graph-safe: list forms, unverified under capture)."""
    if not torch.distributed.is_available():
        return
    from .._collectives import COMM_DTYPES
    from . import collectives as C

    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        registry.add_kernel(
            KernelSpec(
                f"reference.{op}",
                op,
                getattr(C, op),
                priority=0,
                device_types=frozenset({"cpu", "cuda"}),
                dtypes=COMM_DTYPES,
                is_reference=True,
                graph_safe=False,
                supports_backward=False,
                description=f"reference {op} (torch.distributed list form, any transport)",
            )
        )
