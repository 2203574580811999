"""Intel Extension for PyTorch (IPEX) CPU kernels: ``ipex.rms_norm`` (plain and fused residual add) and
``ipex.paged_attention`` (decode and causal prefill/append over our paged KV cache).

Sources read (intel_extension_for_pytorch 2.8.0 wheel, Python side; C++ ``csrc/cpu/aten/kernels``):

- ``llm/functional/fusions.py``: ``rms_norm(hidden_states, weight, eps)`` -> ``torch.ops.torch_ipex.rmsnorm``;
  ``add_rms_norm(residual, x, weight, bias, eps, add_back)`` -> ``torch.ops.torch_ipex.add_rmsnorm(x,
  residual, weight, eps, add_back)`` (``bias`` must be None). ``RMSNormKrnl.cpp``: x float32/bfloat16/float16,
  weight any of the three, output in x's dtype; the row statistic *and the weight multiply* are done in
  float32 and cast once at the end (``F.rms_norm``'s order, not Hugging Face Llama's cast-then-multiply:
  within one rounding step of it). With ``add_back=True`` the sum ``x + residual`` is stored into the
  ``residual`` buffer: the adapter passes a fresh copy, so callers' tensors are never written. The vectorized
  kernel exists only in IPEX's AVX-512 build variant (``CPU_CAPABILITY_AVX512``); on AVX2 CPUs the op falls
  back to a composite of ATen calls that is slower than ``torch_native`` -> ``cpu_isa`` requires ``avx512``.
- ``llm/modules/mha_fusion.py`` ``PagedAttention.single_query_cached_kv_attention(out, query, key_cache,
  value_cache, head_mapping, scale, block_tables, context_lens, block_size, max_context_len,
  alibi_slopes)`` and ``PagedAttention.flash_attn_varlen_func(out, query, k_cache, v_cache, cu_seqlens_q,
  cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale, is_causal, block_tables,
  alibi_slopes)``. ``PagedAttentionKrnl.cpp``: caches are ``[num_blocks, Hkv, block_size,
  D]`` addressed through ``stride(0..2)``; the decode kernel honours all three strides (so our NHD and HND
  caches both work as views, no copy), int32 ``block_tables`` / ``context_lens``, q/out/cache float32,
  bfloat16 or float16, at most 16 query heads per KV head (a ``logits[16 * 128]`` stack buffer). The varlen
  kernel reads each page's rows with a leading dimension of ``D`` (only HND pages are contiguous per head),
  supports float32 and bfloat16 only, and refuses ``is_causal=False`` (``TORCH_CHECK``); its causal mask is
  aligned bottom-right, like ``lz.paged_attention``. Both kernels' vector paths are AVX-512 only
  (``#if defined(CPU_CAPABILITY_AVX512)``; else scalar loops).

Not adapted: ``ipex.llm.functional.varlen_attention`` (for ``lz.attention``): on CPU IPEX 2.8 pads the
varlen batch to dense tensors and calls ``torch.nn.functional.scaled_dot_product_attention`` itself,
ignoring ``softmax_scale`` and ``pdropout`` -- it cannot beat ``torch_sdpa`` and does not honour the
``scale=`` contract. IPEX refuses to import on a CPU without AVX2 (``sys.exit``), hence ``avx2`` in every
``cpu_isa`` too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from layerzero.backends._optional import missing_kernel
from layerzero.core.context import SelectionContext
from layerzero.core.kv_layout import KVLayout, cache_dims, nhd_view
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec

R = ReasonCode
CPU = frozenset({"cpu"})
FLOATS = frozenset({torch.float32, torch.bfloat16, torch.float16})
VARLEN_DTYPES = frozenset({torch.float32, torch.bfloat16})
ISA = frozenset({"avx2", "avx512"})
"""IPEX imports only with AVX2; its fused CPU kernels are vectorized only in the AVX-512 build variant."""
PRIORITY_RMS = 60
"""Above torch_native (50): one fused pass per row (measured on AVX-512 CPUs by Intel; not run here)."""
PRIORITY_PAGED = 30
"""Above torch_sdpa.paged_attention (10): no gather of the KV blocks into a padded copy."""
MAX_GQA = 16
"""``single_query_cached_kv_attention`` keeps ``logits[16 * PARTITION_SIZE]`` per head group on the stack."""
KERNEL_IDS = ("ipex.rms_norm", "ipex.paged_attention")
INSTALL_HINT = (
    "pip install intel-extension-for-pytorch==<torch major.minor>.* (IPEX releases pin one torch "
    "minor version; 2.8.0 is the last and needs torch 2.8)"
)


def rms_norm_call(functional: Any) -> Callable[..., Any]:
    """Wrap ``ipex.llm.functional`` as a canonical rms_norm kernel ``(x [..., H], weight [H], eps, residual
    [..., H] | None) -> y [..., H]`` or ``(y, x + residual)``, in x's dtype (float32/bfloat16/float16).

    The fused path calls ``add_rms_norm(residual_copy, x, weight, None, eps, add_back=True)``: IPEX writes
    ``x + residual`` into ``residual_copy`` (a contiguous clone, which the kernel requires) and returns the
    normalized sum; the caller's ``residual`` is not modified.
    """

    def run(x, weight, eps, residual):
        if residual is None:
            return functional.rms_norm(x, weight, eps)
        h = residual.clone(memory_format=torch.contiguous_format)
        y = functional.add_rms_norm(h, x, weight, None, eps, True)
        return y, h

    run.__name__ = "ipex_rms_norm"
    return run


def _cache_views(kv_cache: torch.Tensor, layout: KVLayout | str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as ``[num_blocks, Hkv, block_size, D]`` views of our ``[num_blocks, 2, ...]`` cache (the
    HND cache's own ``[:, 0]`` / ``[:, 1]`` strides; NHD through strides, no copy)."""
    cache = nhd_view(kv_cache, layout)  # [N, 2, P, Hkv, D]
    return cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)


def paged_attention_call(paged: Any) -> Callable[..., Any]:
    """Wrap ``ipex.llm.modules.PagedAttention`` as a canonical paged_attention kernel ``(q [T, Hq, D],
    kv_cache, block_tables [B, max_blocks] int32, seq_lens [B] int32, cu_seqlens_q [B+1] int32 | None, scale,
    is_causal, kv_layout) -> out [T, Hq, D]`` in q's dtype.

    Decode (``cu_seqlens_q`` None), and a prefill call with at most one query token (it is a decode of the one
    sequence that has it: bottom-right causal lets one token see its whole sequence), go to
    ``single_query_cached_kv_attention``; other prefill/append calls to ``flash_attn_varlen_func`` with
    ``cu_seqlens_kv`` = prefix sums of ``seq_lens`` (HND caches, float32/bfloat16, causal only: the
    kernel's check refuses the rest at selection). ``max_context_len``/``max_seqlen_*`` are read on the host.
    """

    def run(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout):
        num_tokens, hq, d = q.shape
        sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
        if num_tokens == 0:
            return q.new_empty(0, hq, d)
        k_cache, v_cache = _cache_views(kv_cache, kv_layout)
        _, block_size, hkv, _ = cache_dims(kv_cache, kv_layout)
        q = q.contiguous()
        out = torch.empty_like(q)
        if cu_seqlens_q is not None and num_tokens == 1:
            s = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).argmax())  # the one sequence with a query token
            block_tables, seq_lens, cu_seqlens_q = block_tables[s : s + 1], seq_lens[s : s + 1], None
        if cu_seqlens_q is None:
            head_mapping = torch.arange(hkv, dtype=torch.int32).repeat_interleave(hq // hkv)
            paged.single_query_cached_kv_attention(
                out,
                q,
                k_cache,
                v_cache,
                head_mapping,
                sm_scale,
                block_tables.contiguous(),
                seq_lens.contiguous(),
                block_size,
                int(seq_lens.max()),
                None,
            )
            return out
        cu_kv = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32)
        torch.cumsum(seq_lens, 0, out=cu_kv[1:])
        max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        paged.flash_attn_varlen_func(
            out,
            q,
            k_cache,
            v_cache,
            cu_seqlens_q.contiguous(),
            cu_kv,
            max_q,
            int(seq_lens.max()),
            sm_scale,
            True,
            block_tables.contiguous(),
            None,
        )
        return out

    run.__name__ = "ipex_paged_attention"
    return run


def _rms_check(ctx: SelectionContext) -> list[Reason]:
    if ctx.param_dtype is not None and ctx.param_dtype not in FLOATS:
        return [
            Reason(
                R.DTYPE_UNSUPPORTED,
                f"weight dtype {str(ctx.param_dtype).removeprefix('torch.')} not in "
                "[bfloat16, float16, float32] (torch_ipex::rmsnorm)",
            )
        ]
    return []


def _paged_check(ctx: SelectionContext) -> list[Reason]:
    """Rules data cannot say: GQA ratio <= 16; prefill/append (more than one query token) needs an HND cache,
    float32/bfloat16 and is_causal=True."""
    out = []
    ratio = ctx.gqa_ratio
    if ratio is not None and ratio > MAX_GQA:
        out.append(
            Reason(
                R.GQA_RATIO_INVALID,
                f"at most {MAX_GQA} query heads per KV head, got {ratio} "
                "(single_query_cached_kv_attention's stack buffer)",
            )
        )
    if ctx.seq_len_q is not None and ctx.seq_len_q > 1:
        if ctx.kv_layout != KVLayout.HND:
            out.append(
                Reason(
                    R.KV_LAYOUT_UNSUPPORTED,
                    f"prefill/append reads each page as [block_size, D] rows (flash_attn_varlen_func): "
                    f"needs kv_layout='HND', got {ctx.kv_layout!r}",
                )
            )
        if ctx.dtype not in VARLEN_DTYPES:
            out.append(
                Reason(
                    R.DTYPE_UNSUPPORTED,
                    f"prefill/append supports float32 and bfloat16, got "
                    f"{str(ctx.dtype).removeprefix('torch.')}",
                )
            )
        if not ctx.is_causal:
            out.append(
                Reason(
                    R.CAUSAL_UNSUPPORTED,
                    "prefill/append is causal only (flash_attn_varlen_func refuses is_causal=False)",
                )
            )
    return out


def kernel_specs(
    api: dict[str, Any] | None, why: str = "intel_extension_for_pytorch is not available"
) -> list[KernelSpec]:
    """The IPEX KernelSpecs ``[ipex.rms_norm, ipex.paged_attention]`` (CPU only, ``cpu_isa`` avx2 + avx512).

    Args:
        api: ``{"functional": ipex.llm.functional, "paged": ipex.llm.modules.PagedAttention}`` from the probe,
            or None when IPEX is unusable (the specs are still registered; their callables raise
            ``BackendNotAvailableError`` with ``why``).
        why: the reason shown by those callables.
    """
    api = api or {}
    functional, paged = api.get("functional"), api.get("paged")
    common: dict[str, Any] = dict(device_types=CPU, cpu_isa=ISA, deterministic=True)
    return [
        KernelSpec(
            KERNEL_IDS[0],
            "rms_norm",
            rms_norm_call(functional)
            if functional is not None
            else missing_kernel(KERNEL_IDS[0], why, INSTALL_HINT),
            priority=PRIORITY_RMS,
            dtypes=FLOATS,
            supports_backward=False,
            graph_safe=True,
            description="IPEX torch_ipex::rmsnorm / add_rmsnorm (AVX-512, fp32 math, weight multiply "
            "before the cast)",
            check=_rms_check,
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[1],
            "paged_attention",
            paged_attention_call(paged)
            if paged is not None
            else missing_kernel(KERNEL_IDS[1], why, INSTALL_HINT),
            priority=PRIORITY_PAGED,
            dtypes=FLOATS,
            supports_backward=False,
            graph_safe=False,
            description="IPEX PagedAttention: single_query_cached_kv_attention (decode, NHD/HND views) "
            "and flash_attn_varlen_func (causal prefill/append, HND)",
            check=_paged_check,
            **common,
        ),
    ]
