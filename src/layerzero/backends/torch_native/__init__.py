"""Native PyTorch kernels: fused ``F.rms_norm`` (torch >= 2.4), ``F.layer_norm``, and RoPE in the input dtype.

``F.rms_norm`` normalizes in float32 internally and multiplies by the weight before casting back; Hugging
Face's Llama-family RMSNorm casts before the weight multiply. The two agree exactly in float32 and to
within one rounding step in float16/bfloat16 (see docs/backends.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.registry import KernelRegistry
from layerzero.core.specs import BackendSpec, KernelSpec, Layout

from .cache import kernel_spec as cache_kernel_spec

FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


_RMS = (
    torch.rms_norm
)  # F.rms_norm is a Python wrapper of it (a __torch_function__ check torch.rms_norm does in C)


def _rms_norm(x, weight, eps, residual):
    if residual is None:
        return _RMS(x, (x.shape[-1],), weight, eps)
    h = x + residual
    return _RMS(h, (h.shape[-1],), weight, eps), h


def _rms_specialize(ctx):
    """``torch.rms_norm`` (what ``F.rms_norm`` calls) with the key's hidden size bound: no ``x.shape`` read,
    no branch per call; the fused-residual form returns ``(rms_norm(x + residual), x + residual)``. None (the
    generic :func:`_rms_norm`) for a key without a hidden size."""
    if ctx.hidden_size is None:
        return None
    shape = (ctx.hidden_size,)
    rms = _RMS

    if ctx.fused_residual:

        def rms_norm_residual(x, weight, eps, residual):
            h = x + residual
            return rms(h, shape, weight, eps), h

        return rms_norm_residual

    def rms_norm(x, weight, eps, residual):  # residual: None for every call of such a key
        return rms(x, shape, weight, eps)

    return rms_norm


def _layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


_HALF = frozenset({torch.float16, torch.bfloat16})


def _layer_norm_check(ctx) -> list[Reason]:
    """F.layer_norm takes parameters in x's dtype; on CPU also float32 parameters for half/bfloat16 x."""
    p = ctx.param_dtype
    if (
        p is None
        or p == ctx.dtype
        or (ctx.device.device_type == "cpu" and ctx.dtype in _HALF and p == torch.float32)
    ):
        return []
    return [
        Reason(
            ReasonCode.DTYPE_MISMATCH,
            f"parameters in {str(p).removeprefix('torch.')} with x in {str(ctx.dtype).removeprefix('torch.')}"
            " (needs equal dtypes; on CPU float32 parameters with half-precision x also work)",
        )
    ]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_every_two(x):
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def _rope(q, k, cos, sin, position_ids, interleaved, layout):
    """RoPE in the inputs' own dtype, operation for operation as transformers' ``apply_rotary_pos_emb``
    (bit-identical to it for the half-rotation style in every dtype); partial rotary passes dims >= R."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    elif cos.dim() == 2:
        seq = q.shape[2] if layout == "BHSD" else q.shape[1]
        cos, sin = cos[:seq].unsqueeze(0), sin[:seq].unsqueeze(0)
    axis = 1 if layout == "BHSD" else 2
    cos, sin = cos.unsqueeze(axis), sin.unsqueeze(axis)
    rotate = _rotate_every_two if interleaved else _rotate_half
    r = cos.shape[-1]

    def apply(x):
        # .to() of the same dtype returns the tensor itself but costs ~2.4 µs of dispatch on the AVX2 CI CPU
        c, s = (cos, sin) if cos.dtype == x.dtype else (cos.to(x.dtype), sin.to(x.dtype))
        if r == x.shape[-1]:
            return (x * c) + (rotate(x) * s)
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat(((x_rot * c) + (rotate(x_rot) * s), x_pass), dim=-1)

    return apply(q), apply(k)


def _qk_norm_rope(q, k, q_weight, k_weight, cos, sin, position_ids, interleaved, layout, eps):
    """``lz.qk_norm_rope`` as the two-op form: ``F.rms_norm`` over each head's D dims (rounded to the input
    dtype, as Qwen3's ``q_norm`` / ``k_norm`` are), then :func:`_rope` in the input dtype."""
    d = q.shape[-1]
    return _rope(
        F.rms_norm(q, (d,), q_weight, eps),
        F.rms_norm(k, (d,), k_weight, eps),
        cos,
        sin,
        position_ids,
        interleaved,
        layout,
    )


def _swiglu(gate, up):
    """SwiGLU exactly as Hugging Face ``LlamaMLP`` writes it: ``F.silu(gate) * up`` in the input dtype."""
    return F.silu(gate) * up


def _geglu(gate, up, approximate):
    """GeGLU as Hugging Face gated MLPs write it: ``ACT2FN["gelu" | "gelu_pytorch_tanh"](gate) * up``."""
    return F.gelu(gate, approximate=approximate) * up


def _reglu(gate, up):
    """ReGLU: ``F.relu(gate) * up`` in the input dtype."""
    return F.relu(gate) * up


def _embedding(input_ids, weight, padding_idx):
    """``F.embedding(input_ids, weight, padding_idx)``: ``[...]`` ids, ``[V, H]`` weight -> ``[..., H]``."""
    return F.embedding(input_ids, weight, padding_idx)


def _linear(x, weight, bias):
    """``F.linear(x, weight, bias)``: ``[..., K]`` x, ``[N, K]`` weight, ``[N]`` bias -> ``[..., N]`` (cuBLAS
    on CUDA, oneDNN / MKL on CPU)."""
    return F.linear(x, weight, bias)


def _rms_norm_linear(x, norm_weight, weight, bias, residual, eps):
    """``lz.rms_norm_linear`` as the two-op form, bit for bit: ``F.rms_norm`` (after ``x + residual`` in the
    input dtype), then ``F.linear``."""
    if residual is None:
        return F.linear(_RMS(x, (x.shape[-1],), norm_weight, eps), weight, bias)
    h = x + residual
    return F.linear(_RMS(h, (h.shape[-1],), norm_weight, eps), weight, bias), h


def _swiglu_linear(gate, up, weight, bias):
    """``lz.swiglu_linear`` as the two-op form, bit for bit: ``F.silu(gate) * up``, then ``F.linear``."""
    return F.linear(F.silu(gate) * up, weight, bias)


def register(registry: KernelRegistry) -> None:
    """Add the torch_native backend: fused rms_norm and layer_norm from torch.nn.functional, RoPE and SwiGLU
    in the input dtype, and the KV-cache write."""
    has_rms = hasattr(F, "rms_norm")
    reasons = (
        ()
        if has_rms
        else (Reason(ReasonCode.TORCH_TOO_OLD, "torch.nn.functional.rms_norm needs torch >= 2.4"),)
    )
    registry.add_backend(
        BackendSpec(
            "torch_native",
            "torch",
            torch.__version__,
            True,
            reasons,
            description="torch.nn.functional fused norms",
        )
    )
    devices = frozenset({"cpu", "cuda", "mps", "xpu"})
    if has_rms:
        registry.add_kernel(
            KernelSpec(
                "torch_native.rms_norm",
                "rms_norm",
                _rms_norm,
                priority=50,
                description="torch.nn.functional.rms_norm",
                device_types=devices,
                dtypes=FLOATS,
                specialize=_rms_specialize,
            )
        )
    registry.add_kernel(
        KernelSpec(
            "torch_native.rope",
            "rope",
            _rope,
            priority=50,
            description="RoPE in the input dtype with torch ops (HF apply_rotary_pos_emb order)",
            device_types=devices,
            dtypes=FLOATS,
            layouts=frozenset({Layout.BHSD, Layout.BSHD}),
        )
    )
    if has_rms:
        registry.add_kernel(
            KernelSpec(
                "torch_native.rms_norm_linear",
                "rms_norm_linear",
                _rms_norm_linear,
                priority=50,
                description="F.rms_norm, then F.linear (the two-op form)",
                device_types=devices,
                dtypes=FLOATS,
            )
        )
    if has_rms:  # 10-20% faster than the reference's float32 form on CPU (1-512 tokens of Qwen3's heads)
        registry.add_kernel(
            KernelSpec(
                "torch_native.qk_norm_rope",
                "qk_norm_rope",
                _qk_norm_rope,
                priority=50,
                description="F.rms_norm per head, then RoPE in the input dtype (the two-op "
                "form: two roundings)",
                device_types=devices,
                dtypes=FLOATS,
                layouts=frozenset({Layout.BHSD, Layout.BSHD}),
            )
        )
    registry.add_kernel(cache_kernel_spec())
    from .token_bitmask import kernel_spec as bitmask_kernel_spec  # lz.apply_token_bitmask

    registry.add_kernel(bitmask_kernel_spec())
    from .quantize import kernel_specs as quant_kernel_specs  # quantize, dequantize, quantized_linear

    for spec in quant_kernel_specs():
        registry.add_kernel(spec)
    from .fp8_linear import kernel_spec as fp8_linear_spec  # lz.fp8_linear (torch._scaled_mm)

    registry.add_kernel(fp8_linear_spec())
    registry.add_kernel(
        KernelSpec(
            "torch_native.layer_norm",
            "layer_norm",
            _layer_norm,
            priority=50,
            description="torch.nn.functional.layer_norm",
            device_types=devices,
            dtypes=FLOATS,
            check=_layer_norm_check,
        )
    )
    from .linear_ce import linear_cross_entropy  # lz.linear_cross_entropy, chunked over rows

    registry.add_kernel(
        KernelSpec(
            "torch_native.linear_cross_entropy",
            "linear_cross_entropy",
            linear_cross_entropy,
            priority=50,
            description="chunked over rows (O(chunk x V) logits), backward by recomputation",
            device_types=devices,
            dtypes=FLOATS,
            supports_softcap=True,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "torch_native.swiglu_linear",
            "swiglu_linear",
            _swiglu_linear,
            priority=50,
            description="F.silu(gate) * up, then F.linear (the two-op form)",
            device_types=devices,
            dtypes=FLOATS,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "torch_native.swiglu",
            "swiglu",
            _swiglu,
            priority=50,
            description="F.silu(gate) * up in the input dtype (HF LlamaMLP, bit-identical)",
            device_types=devices,
            dtypes=FLOATS,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "torch_native.geglu",
            "geglu",
            _geglu,
            priority=50,
            description="F.gelu(gate, approximate) * up in the input dtype (HF gated MLPs)",
            device_types=devices,
            dtypes=FLOATS,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "torch_native.embedding",
            "embedding",
            _embedding,
            priority=50,
            description="torch.nn.functional.embedding (padding_idx gets no gradient)",
            device_types=devices,
            dtypes=FLOATS,
        )
    )
    from .sampling import sample  # lz.sample by inverse CDF (CPU)

    registry.add_kernel(
        KernelSpec(
            "torch_native.sample",
            "sample",
            sample,
            priority=5,
            description="inverse-CDF draw, one uniform per unseeded row (the reference's "
            "race for seeded rows): no [B, V] noise",
            device_types=frozenset({"cpu"}),
            dtypes=FLOATS,
            supports_backward=False,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "torch_native.linear",
            "linear",
            _linear,
            priority=50,
            description="torch.nn.functional.linear (cuBLAS / oneDNN)",
            device_types=devices,
            dtypes=FLOATS,
        )
    )
    registry.add_kernel(
        KernelSpec(
            "torch_native.reglu",
            "reglu",
            _reglu,
            priority=50,
            description="F.relu(gate) * up in the input dtype",
            device_types=devices,
            dtypes=FLOATS,
        )
    )
