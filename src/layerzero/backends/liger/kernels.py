"""Liger-Kernel (Triton) kernels for ``rms_norm`` (plain and fused residual add), ``rope`` and ``swiglu``;
``layer_norm`` and ``linear_cross_entropy`` are in ``fused.py``.

Sources read (liger-kernel 0.8.5, ``liger_kernel/ops``):

- ``rms_norm.py``: ``LigerRMSNormFunction.apply(X, W, eps, offset=0.0, casting_mode="llama", in_place=True,
  row_mode=None)``. Casting mode ``"llama"`` matches Hugging Face ``LlamaRMSNorm``: the inverse RMS in
  float32, the normalized row cast back to x's dtype, then multiplied by ``offset + W`` (offset 0.0 here;
  Gemma uses 1.0). The output has X's dtype. Hidden sizes up to 65536 (``calculate_settings``: one Triton
  block per row).
- ``fused_add_rms_norm.py``: ``LigerFusedAddRMSNormFunction.apply(X, R, W, eps, offset, casting_mode,
  in_place)`` returns ``(rms_norm(X + R), X + R)``, the sum stored in X's dtype: exactly ``lz.rms_norm``'s
  ``residual=`` contract.
- ``rope.py``: ``LigerRopeFunction.apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1,
  rotary_dim=None)``: q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]`` (BHSD *views*), cos/sin ``[1 or B, S, R]``
  (or ``[S, R]``) in the duplicated ``cat(f, f)`` half-rotation layout; ``position_ids`` is accepted and
  ignored, so gathering cos/sin by position is our job. It rotates **in place** in ``[B, S, H, D]`` memory
  (``q.transpose(1, 2).contiguous()`` is a no-op for BSHD storage), so the wrappers below always hand it a
  fresh copy. Partial rotary (R < D) needs the ``rotary_dim`` parameter (0.8.x); interleaved (GPT-J) pairs are
  not implemented.
- ``swiglu.py``: ``LigerSiLUMulFunction.apply(a, b, gate_multiplier=1.0,
  down_multiplier=1.0)`` computes ``silu(a_f32).to(b.dtype) * b`` (silu in float32, rounded to the input
  dtype, product in the input dtype: Hugging Face ``LlamaMLP``'s rounding) one program per row of
  ``[rows, I]`` (``ensure_contiguous`` copies non-contiguous inputs); ``calculate_settings`` refuses I whose
  next power of two exceeds 65536. Its backward writes the gradients *into the saved a and b* (the caller's
  gate/up when they were contiguous), so the kernel is declared forward-only (``supports_backward=False``):
  with autograd recording, other kernels serve.

All kernels are Triton, JIT-compiled per specialization (block size, head counts, head dim): not graph-safe
(a first call inside a CUDA-graph capture would compile there).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from layerzero.backends._optional import missing_kernel
from layerzero.core.context import SelectionContext
from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Layout

from .fused import (
    LCE_FLOATS,
    layer_norm_call,
    layer_norm_check,
    linear_cross_entropy_call,
    linear_cross_entropy_check,
)

R = ReasonCode
CUDA = frozenset({"cuda"})
FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
PRIORITY = 40
"""Below torch_native (50) and our Triton kernels: measured on the H200 (bf16, H=4096, end-to-end through
lz.tune) Liger's autograd-Function launch costs 65-117 µs per call where F.rms_norm takes 12-46 µs, and it
only wins for fused add + RMSNorm over 8192 rows (79 vs 94 µs); lz.tune promotes it where it is faster
(benchmarks/results/norm_rope_h200.md)."""
MAX_HIDDEN = 65536
"""Liger's ``calculate_settings`` refuses rows whose next power of two exceeds 65536 elements."""
SM_MIN = (8, 0)
"""Triton's supported NVIDIA range starts at compute capability 8.0 (and bfloat16 needs it)."""
KERNEL_IDS = (
    "liger.rms_norm",
    "liger.rope",
    "liger.swiglu",
    "liger.layer_norm",
    "liger.linear_cross_entropy",
)
INSTALL_HINT = "pip install liger-kernel (needs triton and a CUDA build of torch)"


def rms_norm_call(plain: Any, fused: Any | None) -> Callable[..., Any]:
    """Wrap ``LigerRMSNormFunction`` / ``LigerFusedAddRMSNormFunction`` as a canonical rms_norm kernel
    ``(x [..., H], weight [H], eps, residual [..., H] | None) -> y`` or ``(y, x + residual)``, Llama casting,
    offset 0.0, ``in_place=False`` (Liger's default True overwrites the incoming gradient in backward)."""

    def run(x, weight, eps, residual):
        if residual is None:
            return plain.apply(x, weight, eps, 0.0, "llama", False)
        if fused is None:  # selection never gets here: the check rejects fused_residual
            raise BackendNotAvailableError(
                "liger.rms_norm cannot fuse the residual add: this liger_kernel has no "
                "LigerFusedAddRMSNormFunction. Upgrade liger-kernel (>= 0.6) or call without residual=."
            )
        y, h = fused.apply(x, residual, weight, eps, 0.0, "llama", False)
        return y, h

    run.__name__ = "liger_rms_norm"
    return run


def _rope_inputs(q, cos, sin, position_ids, bshd: bool):
    """cos/sin as Liger wants them, ``[1 or B, S, R]``: gathered by ``position_ids`` or the first S rows."""
    if position_ids is not None:
        return cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        s = q.shape[1] if bshd else q.shape[2]
        return cos[:s].unsqueeze(0), sin[:s].unsqueeze(0)
    return cos, sin


def rope_call(function: Any) -> Callable[..., Any]:
    """Wrap ``LigerRopeFunction`` as a canonical rope kernel ``(q, k, cos, sin, position_ids, interleaved,
    layout) -> (q', k')`` for both layouts. Liger rotates in place in ``[B, S, H, D]`` memory, so q and k are
    first copied into fresh BSHD-contiguous tensors (one copy each, what Liger itself does for BHSD-contiguous
    inputs); the caller's tensors are never modified. Outputs keep the input layout (BHSD outputs are views
    of BSHD memory)."""

    def run(q, k, cos, sin, position_ids, interleaved, layout):
        bshd = layout is Layout.BSHD or layout == "BSHD"
        cos, sin = _rope_inputs(q, cos, sin, position_ids, bshd)
        qb = (q if bshd else q.transpose(1, 2)).clone(memory_format=torch.contiguous_format)
        kb = (k if bshd else k.transpose(1, 2)).clone(memory_format=torch.contiguous_format)
        qo, ko = function.apply(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin, None, 1)
        return (qo.transpose(1, 2), ko.transpose(1, 2)) if bshd else (qo, ko)

    run.__name__ = "liger_rope"
    return run


def swiglu_call(function: Any) -> Callable[..., Any]:
    """Wrap ``LigerSiLUMulFunction`` as a canonical swiglu kernel ``(gate [..., I], up [..., I]) -> out``
    (gate and down multipliers 1.0, i.e. plain SwiGLU)."""

    def run(gate, up):
        return function.apply(gate, up, 1.0, 1.0)

    run.__name__ = "liger_swiglu"
    return run


def _swiglu_check(present: bool) -> Callable[[SelectionContext], list[Reason]]:
    def check(ctx: SelectionContext) -> list[Reason]:
        out = []
        if ctx.hidden_size is not None and ctx.hidden_size > MAX_HIDDEN:
            out.append(
                Reason(
                    R.HIDDEN_SIZE_UNSUPPORTED,
                    f"intermediate size {ctx.hidden_size} > {MAX_HIDDEN} (one Triton block per row)",
                )
            )
        if not present:
            out.append(
                Reason(
                    R.BACKEND_VERSION_UNSUPPORTED,
                    "this liger_kernel has no liger_kernel.ops.swiglu.LigerSiLUMulFunction; upgrade it",
                )
            )
        return out

    return check


def supports_partial_rotary(function: Any) -> bool:
    """Whether this Liger's ``LigerRopeFunction.forward`` takes ``rotary_dim`` (partial RoPE, 0.8.x)."""
    try:
        return "rotary_dim" in inspect.signature(function.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def _rms_check(has_fused: bool) -> Callable[[SelectionContext], list[Reason]]:
    def check(ctx: SelectionContext) -> list[Reason]:
        out = []
        if ctx.hidden_size is not None and ctx.hidden_size > MAX_HIDDEN:
            out.append(
                Reason(
                    R.HIDDEN_SIZE_UNSUPPORTED,
                    f"hidden size {ctx.hidden_size} > {MAX_HIDDEN} (one Triton block per row)",
                )
            )
        if ctx.param_dtype is not None and ctx.param_dtype not in FLOATS:
            out.append(
                Reason(
                    R.DTYPE_UNSUPPORTED,
                    f"weight dtype {str(ctx.param_dtype).removeprefix('torch.')} "
                    "not in [bfloat16, float16, float32]",
                )
            )
        if ctx.fused_residual and not has_fused:
            out.append(
                Reason(
                    R.BACKEND_VERSION_UNSUPPORTED,
                    "this liger_kernel has no LigerFusedAddRMSNormFunction (fused add + RMSNorm); "
                    "upgrade liger-kernel or call without residual=",
                )
            )
        return out

    return check


def _rope_check(partial: bool) -> Callable[[SelectionContext], list[Reason]]:
    def check(ctx: SelectionContext) -> list[Reason]:
        out = []
        if ctx.interleaved:
            out.append(
                Reason(
                    R.LAYOUT_UNSUPPORTED,
                    "Liger rotates halves (GPT-NeoX/Llama style); interleaved=True (GPT-J pairs) is "
                    "not implemented",
                )
            )
        if (
            not partial
            and ctx.rotary_dim is not None
            and ctx.head_dim is not None
            and ctx.rotary_dim != ctx.head_dim
        ):
            out.append(
                Reason(
                    R.HEAD_DIM_MISMATCH,
                    f"partial rotary (R={ctx.rotary_dim} < D={ctx.head_dim}) needs liger-kernel "
                    ">= 0.8 (rotary_dim)",
                )
            )
        return out

    return check


def kernel_specs(
    functions: dict[str, Any] | None, why: str = "liger_kernel is not available"
) -> list[KernelSpec]:
    """The Liger KernelSpecs ``[liger.rms_norm, liger.rope, liger.swiglu, liger.layer_norm,
    liger.linear_cross_entropy]`` (the last two: ``fused.py``).

    Args:
        functions: ``{"rms_norm": LigerRMSNormFunction, "fused_add_rms_norm": LigerFusedAddRMSNormFunction or
            None, "rope": LigerRopeFunction, "swiglu": LigerSiLUMulFunction or None}`` from the probe, or None
            when the library is unusable (the specs are still registered; their callables raise
            ``BackendNotAvailableError`` with ``why``).
    """
    functions = functions or {}
    plain, fused, rope = functions.get("rms_norm"), functions.get("fused_add_rms_norm"), functions.get("rope")
    silu_mul = functions.get("swiglu")
    common: dict[str, Any] = dict(
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        priority=PRIORITY,
        deterministic=True,
        graph_safe=False,
        supports_backward=True,
    )
    rms_fn = (
        rms_norm_call(plain, fused) if plain is not None else missing_kernel(KERNEL_IDS[0], why, INSTALL_HINT)
    )
    rope_fn = rope_call(rope) if rope is not None else missing_kernel(KERNEL_IDS[1], why, INSTALL_HINT)
    swiglu_why = (
        why if plain is None else "this liger_kernel has no LigerSiLUMulFunction (liger_kernel.ops.swiglu)"
    )
    swiglu_fn = (
        swiglu_call(silu_mul)
        if silu_mul is not None
        else missing_kernel(KERNEL_IDS[2], swiglu_why, INSTALL_HINT)
    )
    ln, lce = functions.get("layer_norm"), functions.get("linear_cross_entropy")
    ln_why = (
        why
        if plain is None
        else "this liger_kernel has no LigerLayerNormFunction (liger_kernel.ops.layer_norm)"
    )
    lce_why = (
        why
        if plain is None
        else (
            "this liger_kernel has no LigerFusedLinearCrossEntropyFunction "
            "(liger_kernel.ops.fused_linear_cross_entropy)"
        )
    )
    ln_fn = layer_norm_call(ln) if ln is not None else missing_kernel(KERNEL_IDS[3], ln_why, INSTALL_HINT)
    lce_fn = (
        linear_cross_entropy_call(lce)
        if lce is not None
        else missing_kernel(KERNEL_IDS[4], lce_why, INSTALL_HINT)
    )
    return [
        KernelSpec(
            KERNEL_IDS[0],
            "rms_norm",
            rms_fn,
            description="Liger LigerRMSNormFunction (Triton, llama casting, offset 0) and "
            "LigerFusedAddRMSNormFunction for residual=",
            check=_rms_check(fused is not None or plain is None),
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[1],
            "rope",
            rope_fn,
            description="Liger LigerRopeFunction (Triton, half rotation, partial rotary, in place on a copy)",
            layouts=frozenset({Layout.BHSD, Layout.BSHD}),
            check=_rope_check(rope is None or supports_partial_rotary(rope)),
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[2],
            "swiglu",
            swiglu_fn,
            description="Liger LigerSiLUMulFunction (Triton, silu in fp32 cast to the input dtype, x up; "
            "forward only: its backward overwrites the saved inputs)",
            check=_swiglu_check(silu_mul is not None or plain is None),
            **{**common, "supports_backward": False},
        ),
        KernelSpec(
            KERNEL_IDS[3],
            "layer_norm",
            ln_fn,
            description="Liger LigerLayerNormFunction (Triton, float32 statistics; zero bias for bias=None)",
            check=layer_norm_check(ln is not None or plain is None),
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[4],
            "linear_cross_entropy",
            lce_fn,
            description="Liger LigerFusedLinearCrossEntropyFunction (Triton, chunked, gradients computed in "
            "forward; reduction='none' backward needs a uniform grad_output)",
            check=linear_cross_entropy_check(lce),
            **{**common, "dtypes": LCE_FLOATS, "deterministic": False, "supports_softcap": True},
        ),
    ]
