"""The composite backend: a fused op run as its parts, each dispatched by LayerZero on its own.

``composite.rms_norm_linear`` is ``lz.rms_norm`` then ``lz.linear``, ``composite.swiglu_linear`` is
``lz.swiglu`` then ``lz.linear``, ``composite.qk_norm_rope_cache`` is ``lz.qk_norm_rope`` then
``lz.reshape_and_cache``, ``composite.rope_paged_attention`` is ``lz.qk_norm_rope_cache`` (``lz.rope`` then
``lz.reshape_and_cache`` without q/k norm weights) then ``lz.paged_attention``: wherever no fused kernel takes
a call (more rows than the fused Triton kernels take, float32, CPU), the op costs exactly what its calls
would, with each part's own best kernel (``triton.rms_norm`` / ``triton.gemv`` / cuBLAS on a GPU,
``torch_native`` on a CPU) and each part's own explanation (``lz.explain`` of the part). Above
``torch_native``'s single-library forms (50), below the fused kernels (55).
"""

from __future__ import annotations

import torch

from layerzero import ops as lz_ops
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec, KernelSpec

PRIORITY = 52
ALL_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu"})
FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def rms_norm_linear(x, norm_weight, weight, bias, residual, eps):
    """``lz.rms_norm_linear`` as ``lz.rms_norm`` (with the residual) then ``lz.linear``: y, or
    ``(y, x + residual)``."""
    if residual is None:
        return lz_ops.linear(lz_ops.rms_norm(x, norm_weight, eps), weight, bias)
    h, residual = lz_ops.rms_norm(x, norm_weight, eps, residual=residual)
    return lz_ops.linear(h, weight, bias), residual


def swiglu_linear(gate, up, weight, bias):
    """``lz.swiglu_linear`` as ``lz.swiglu`` then ``lz.linear``."""
    return lz_ops.linear(lz_ops.swiglu(gate, up), weight, bias)


def qk_norm_rope_cache(
    q, k, v, q_weight, k_weight, cos, sin, kv_cache, slot_mapping, position_ids, interleaved, kv_layout, eps
):
    """``lz.qk_norm_rope_cache`` as ``lz.qk_norm_rope`` (q, k viewed ``[1, T, H, D]`` BSHD) then
    ``lz.reshape_and_cache`` of the rotated k and v; returns ``(q, k)`` token-major."""
    t = q.shape[0]
    qo, ko = lz_ops.qk_norm_rope(
        q.unsqueeze(0),
        k.unsqueeze(0),
        q_weight,
        k_weight,
        cos,
        sin,
        eps=eps,
        position_ids=position_ids.view(1, t),
        interleaved=interleaved,
        layout="BSHD",
    )
    lz_ops.reshape_and_cache(ko[0], v, kv_cache, slot_mapping, kv_layout)
    return qo[0], ko[0]


def rope_paged_attention(
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
    """``lz.rope_paged_attention`` as ``lz.qk_norm_rope_cache`` (weights given) or ``lz.rope`` (q, k viewed
    ``[1, T, H, D]`` BSHD) + ``lz.reshape_and_cache``, then ``lz.paged_attention`` (causal) of the rotated q:
    ``[T, Hq, D]``."""
    if q_weight is None:
        t = q.shape[0]
        qo, ko = lz_ops.rope(
            q.unsqueeze(0),
            k.unsqueeze(0),
            cos,
            sin,
            position_ids=position_ids.view(1, t),
            interleaved=interleaved,
            layout="BSHD",
        )
        qo = qo[0]
        lz_ops.reshape_and_cache(ko[0], v, kv_cache, slot_mapping, kv_layout)
    else:
        qo, _ = lz_ops.qk_norm_rope_cache(
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
    return lz_ops.paged_attention(
        qo,
        kv_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        is_causal=True,
        kv_layout=kv_layout,
    )


def register(registry: KernelRegistry) -> None:
    """Add the composite backend and its kernels."""
    registry.add_backend(
        BackendSpec(
            "composite",
            None,
            torch.__version__,
            True,
            description="fused ops as their parts, each part dispatched by LayerZero",
        )
    )
    for op, fn, parts in (
        ("rms_norm_linear", rms_norm_linear, "lz.rms_norm, then lz.linear"),
        ("swiglu_linear", swiglu_linear, "lz.swiglu, then lz.linear"),
        ("qk_norm_rope_cache", qk_norm_rope_cache, "lz.qk_norm_rope, then lz.reshape_and_cache"),
        (
            "rope_paged_attention",
            rope_paged_attention,
            "lz.qk_norm_rope_cache (or lz.rope and lz.reshape_and_cache), then lz.paged_attention",
        ),
    ):
        registry.add_kernel(
            KernelSpec(
                f"composite.{op}",
                op,
                fn,
                priority=PRIORITY,
                device_types=ALL_DEVICES,
                dtypes=FLOATS,
                deterministic=True,
                description=f"{parts} (each part selected on its own)",
            )
        )
