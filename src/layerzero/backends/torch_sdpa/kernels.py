"""The four SDPA sub-backend kernels and their constraints (PyTorch 2.5 - 2.13 semantics).

Forcing a sub-backend uses the same process-wide switches as ``torch.nn.attention.sdpa_kernel``
(``torch._C._set_sdp_use_*``), set and restored around the call; that context manager itself costs
~10 us of Python per call, the raw switches well under 1 us. Like ``sdpa_kernel`` this is not isolated
between threads that force different sub-backends at the same instant; a call that then finds its
sub-backend disabled raises, and dispatch records it and retries on the next kernel. When the chosen
sub-backend is torch's own first choice (first in ``torch._C._get_sdp_priority_order()`` and enabled; cuDNN
on an H200 with torch 2.11) the switches are not touched at all (see :func:`_forced`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from layerzero.core.context import SelectionContext
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Layout, MaskKind

_C = torch._C
_SDPA = F.scaled_dot_product_attention
_SETTERS = (_C._set_sdp_use_flash, _C._set_sdp_use_mem_efficient, _C._set_sdp_use_math, _C._set_sdp_use_cudnn)
_GETTERS = (
    _C._get_flash_sdp_enabled,
    _C._get_mem_efficient_sdp_enabled,
    _C._get_math_sdp_enabled,
    _C._get_cudnn_sdp_enabled,
)

HALF = frozenset({torch.float16, torch.bfloat16})
FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
CPU_FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


_ORDER = getattr(_C, "_get_sdp_priority_order", None)
_BACKEND_ENUM = (1, 2, 0, 3)
"""``torch.nn.attention.SDPBackend`` values of our sub-backend indices (flash, efficient, math, cudnn)."""


def _forced(which: int) -> Callable[..., Any]:
    """An attention kernel (BHSD, canonical args) that runs SDPA with only sub-backend ``which`` enabled.

    When ``which`` is first in torch's own priority order (``torch._C._get_sdp_priority_order()``, read per
    call: ``sdpa_kernel(..., set_priority=True)`` may change it) and enabled, plain SDPA already runs it for
    every input our constraints accept (the constraint mirroring tests check this against torch itself), so
    the switches are left alone: that saves 4 reads + 6 writes of process-wide flags per call. Otherwise the
    switches force it; a refused input then raises instead of silently running another sub-backend.
    """
    wanted = tuple(i == which for i in range(4))
    enum = _BACKEND_ENUM[which]
    enabled = _GETTERS[which]

    def run(q, k, v, attn_mask, is_causal, scale, dropout_p):
        if _ORDER is not None and _ORDER()[0] == enum and enabled():
            return _SDPA(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        prev = (_GETTERS[0](), _GETTERS[1](), _GETTERS[2](), _GETTERS[3]())
        if prev != wanted:
            for setter, on in zip(_SETTERS, wanted, strict=True):
                setter(on)
        try:
            return _SDPA(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        finally:
            if prev != wanted:
                for setter, on in zip(_SETTERS, prev, strict=True):
                    setter(on)

    run.__name__ = f"sdpa_{('flash', 'efficient', 'math', 'cudnn')[which]}"
    return run


_FLASH = _forced(0)


def _natural(q, k, v, attn_mask, is_causal, scale, dropout_p):
    """Plain SDPA with its own sub-backend choice (used only where that choice is provably ours)."""
    return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _natural_plain(q, k, v, attn_mask, is_causal, scale, dropout_p):
    """:func:`_natural` for keys with no mask, no dropout, default scale and Hq == Hkv (the common case):
    positional arguments only, which saves ~1 us of argument handling per call."""
    return _SDPA(q, k, v, None, 0.0, is_causal)


def _cpu_flash_natural(ctx: SelectionContext):
    """On CPU, SDPA's own order is flash then math, and our flash constraints mirror torch's CPU flash
    checks (tests/unit/test_sdpa_constraints.py), so when flash can run, plain SDPA runs flash too: skip the
    ~2 us of switch toggling. Not on CUDA, where torch's order depends on the cuDNN version: the forced kernel
    there, without the ALiBi wrapper's frame (CUDA flash refuses ALiBi). ALiBi calls (CPU) take the generic
    kernel, which adds the bias (:func:`_with_alibi`)."""
    if ctx.has_alibi:
        return None
    if ctx.device.device_type != "cpu":
        return _FLASH
    plain = (
        ctx.mask is MaskKind.NONE
        and not ctx.dropout
        and ctx.scale_default
        and ctx.num_heads_q == ctx.num_heads_kv
    )
    return _natural_plain if plain else _natural


def _flash_check(ctx: SelectionContext) -> list[Reason]:
    out = []
    dev = ctx.device
    if dev.device_type == "cuda":
        if ctx.is_causal and not ctx.seq_equal:
            out.append(
                Reason(
                    ReasonCode.CAUSAL_SEQ_MISMATCH,
                    "CUDA flash refuses is_causal with Sq != Sk (torch "
                    "check_flash_causal_non_square_seqlens)",
                )
            )
        if ctx.requires_grad and (ctx.head_dim or 0) > 192 and dev.sm in ((8, 6), (8, 9), (12, 0)):
            out.append(
                Reason(
                    ReasonCode.HEAD_DIM_TOO_LARGE,
                    "backward with head_dim > 192 is not supported on SM 8.6/8.9/12.0",
                )
            )
    return out


def _efficient_check(ctx: SelectionContext) -> list[Reason]:
    """Head-dim alignment of mem-efficient attention: 8 elements for fp16/bf16 on SM 8.0+, else 4."""
    if ctx.head_dim is None:
        return []
    align = 8 if ctx.dtype in HALF and ctx.device.sm is not None and ctx.device.sm >= (8, 0) else 4
    dims = {ctx.head_dim, ctx.head_dim_v or ctx.head_dim}
    bad = sorted(d for d in dims if d % align)
    if bad:
        return [Reason(ReasonCode.HEAD_DIM_NOT_ALIGNED, f"head dims {bad} must be multiples of {align}")]
    return []


def _cudnn_check(ctx: SelectionContext) -> list[Reason]:
    """cuDNN rules data cannot say: at least 2 keys; head_dim > 128 only on SM 9.0 / 10.0 (cuDNN frontend
    >= 1.24, torch's kCuDNNFrontendSupportsD256), as measured with torch 2.11 + cuDNN 9.19 on an H200."""
    out = []
    if ctx.seq_len_kv == 1:
        out.append(Reason(ReasonCode.SEQ_LEN_TOO_SHORT, "cuDNN SDPA refuses a single key (Sk == 1)"))
    big = max(ctx.head_dim or 0, ctx.head_dim_v or 0)
    if big > 128 and ctx.device.sm not in ((9, 0), (10, 0)):
        out.append(Reason(ReasonCode.HEAD_DIM_TOO_LARGE, f"head_dim {big} > 128 needs SM 9.0 or 10.0"))
    return out


def kernel_specs() -> list[KernelSpec]:
    """The KernelSpecs of the four sub-backends, constraints as data plus small checks."""
    gqa_mask_kinds = frozenset(MaskKind)
    return [
        # CUDA flash (FA2 inside torch) and the CPU flash kernel share one id: both are "flash" to SDPA.
        KernelSpec(
            "torch_sdpa.flash",
            "attention",
            _with_alibi(_FLASH),
            priority=80,
            description="SDPA FlashAttention-2 (CUDA SM 8.0+, fp16/bf16, no mask) / CPU flash kernel (CPU: "
            "ALiBi as an explicit float32 bias)",
            device_types=frozenset({"cuda", "cpu"}),
            dtypes=CPU_FLOATS,
            sm_min=(8, 0),
            sm_max=(12, 1),
            layouts=frozenset({Layout.BHSD}),
            head_dims_equal=True,
            supports_gqa=True,
            mask_kinds=gqa_mask_kinds,
            mask_with_causal=False,
            supports_dropout=True,
            requires_stride_last_1=True,
            requires_aligned_16=True,
            deterministic=True,
            graph_safe=True,
            supports_alibi=True,
            check=_flash_device_check,
            specialize=_cpu_flash_natural,
        ),
        KernelSpec(
            "torch_sdpa.cudnn",
            "attention",
            _forced(3),
            priority=85,
            description="SDPA cuDNN attention (CUDA SM 8.0-12.1, fp16/bf16; bool masks refused: fully masked "
            "rows come back as garbage, not 0)",
            device_types=frozenset({"cuda"}),
            dtypes=HALF,
            sm_min=(8, 0),
            sm_max=(12, 1),
            layouts=frozenset({Layout.BHSD}),
            head_dim_max=256,
            head_dim_multiple=8,
            head_dims_equal=True,
            supports_gqa=True,
            mask_kinds=frozenset({MaskKind.NONE, MaskKind.FLOAT}),
            mask_with_causal=False,
            supports_dropout=False,
            requires_stride_last_1=True,
            requires_aligned_16=True,
            deterministic=False,
            graph_safe=True,
            check=_cudnn_check,
        ),
        KernelSpec(
            "torch_sdpa.efficient",
            "attention",
            _forced(1),
            priority=70,
            description="SDPA memory-efficient attention (xFormers/CUTLASS kernel, CUDA SM 5.0+)",
            device_types=frozenset({"cuda"}),
            dtypes=FLOATS,
            sm_min=(5, 0),
            sm_max=(12, 1),
            layouts=frozenset({Layout.BHSD}),
            supports_gqa=False,
            mask_kinds=gqa_mask_kinds,
            mask_with_causal=False,
            supports_dropout=True,
            requires_stride_last_1=True,
            requires_aligned_16=True,
            deterministic=True,
            graph_safe=True,
            check=_efficient_check,
        ),
        KernelSpec(
            "torch_sdpa.math",
            "attention",
            _with_alibi(_forced(2)),
            priority=20,
            description="SDPA math (composite PyTorch ops; runs everywhere; ALiBi as an explicit float32 "
            "bias)",
            device_types=frozenset({"cuda", "cpu", "mps", "xpu"}),
            dtypes=CPU_FLOATS,
            layouts=frozenset({Layout.BHSD}),
            supports_gqa=True,
            mask_kinds=gqa_mask_kinds,
            mask_with_causal=False,
            supports_dropout=True,
            deterministic=True,
            graph_safe=True,
            supports_alibi=True,
        ),
        KernelSpec(
            "torch_sdpa.cpu_fp32_upcast",
            "attention",
            _fp32_upcast,
            priority=85,
            description="CPU float16 attention computed by the CPU flash kernel in float32 (inputs upcast, "
            "output rounded once to float16); prefill 1.5-2.5x faster than float16 flash on CPUs without "
            "native fp16 arithmetic (benchmarks/results/cpu_isa.md)",
            device_types=frozenset({"cpu"}),
            dtypes=frozenset({torch.float16}),
            layouts=frozenset({Layout.BHSD}),
            head_dims_equal=True,
            supports_gqa=True,
            mask_kinds=gqa_mask_kinds,
            mask_with_causal=False,
            supports_dropout=False,
            requires_stride_last_1=True,
            deterministic=True,
            graph_safe=True,
            check=_upcast_check,
        ),
    ]


def alibi_bias(
    slopes: torch.Tensor, batch: int, sq: int, sk: int, causal: bool, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """ALiBi as an explicit bias ``[B, Hq, Sq, Sk]`` (``[1, Hq, ...]`` for ``[Hq]`` slopes) in ``dtype``
    (float32 or float64), flash-attn's formula ``-slope[b, h] * |i + Sk - Sq - j|`` (Press et al. 2022;
    positions bottom-right aligned), with ``-inf`` where ``lz.attention``'s top-left causal mask (``j > i``)
    hides a key when ``causal``."""
    i = torch.arange(sq, device=slopes.device, dtype=dtype)[:, None]
    j = torch.arange(sk, device=slopes.device, dtype=dtype)[None, :]
    dist = (i + (sk - sq) - j).abs()
    s = slopes.to(dtype).reshape(-1 if slopes.dim() == 2 else 1, slopes.shape[-1], 1, 1)
    bias = -s * dist
    if causal:
        bias = bias.masked_fill(j > i, float("-inf"))
    return bias.expand(batch if slopes.dim() == 2 else 1, -1, -1, -1)


def _with_alibi(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` (an SDPA kernel) that also serves ``lz.attention(alibi_slopes=...)``: the slopes become an
    explicit bias (:func:`alibi_bias`) added to the caller's mask (a bool mask turns into ``-inf`` where
    False), causality folded into it (SDPA refuses a mask together with ``is_causal``), and the attention
    computed in float32 (float64 for float64 inputs; a half-precision bias would round ``slope * distance`` to
    8 bits), rounded once to q's dtype. Without slopes: ``run``."""

    def call(q, k, v, attn_mask, is_causal, scale, dropout_p, window=None, softcap=None, alibi_slopes=None):
        if alibi_slopes is None:
            return run(q, k, v, attn_mask, is_causal, scale, dropout_p)
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        bias = alibi_bias(alibi_slopes, q.shape[0], q.shape[2], k.shape[2], is_causal, dt)
        if attn_mask is not None:
            bias = (
                bias.masked_fill(~attn_mask, float("-inf"))
                if attn_mask.dtype == torch.bool
                else bias + attn_mask.to(dt)
            )
        out = run(q.to(dt), k.to(dt), v.to(dt), bias, False, scale, dropout_p)
        return out.to(q.dtype)

    call.__name__ = run.__name__
    return call


def _fp32_upcast(q, k, v, attn_mask, is_causal, scale, dropout_p):
    """float16 q/k/v (and float mask) -> float32, SDPA (CPU flash: torch's first choice for float32 on CPU,
    see :func:`_cpu_flash_natural`), result rounded once to q's dtype. Numeric contract: the float32 attention
    of the float16 inputs, so at least as accurate as float16 flash (which also accumulates in float32 but
    rounds its softmax probabilities to float16 before the P @ V product); costs 2 bytes extra per input
    element for the float32 copies."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.float()
    out = _SDPA(
        q.float(),
        k.float(),
        v.float(),
        attn_mask,
        0.0,
        is_causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.to(q.dtype)


def _upcast_check(ctx: SelectionContext) -> list[Reason]:
    """Off on CPUs with native float16 arithmetic (avx512_fp16: Sapphire Rapids and newer), where torch's own
    float16 kernels can use it (not measured: the benchmark CPU has none, so native wins by default), and for
    decode (one query token), where the measured gain was not consistent."""
    out = []
    if "avx512_fp16" in ctx.device.cpu_isa:
        out.append(
            Reason(
                ReasonCode.PLATFORM_UNSUPPORTED,
                "this CPU has native fp16 arithmetic (avx512_fp16): torch's float16 flash kernel is "
                "preferred there (the float32-upcast win was measured only on CPUs without it)",
            )
        )
    if ctx.seq_len_q == 1:
        out.append(
            Reason(
                ReasonCode.SEQ_LEN_TOO_SHORT,
                "decode (Sq == 1) is left to torch's float16 kernels: the float32 upcast was not "
                "consistently faster there (benchmarks/results/cpu_isa.md)",
            )
        )
    return out


@functools.cache
def aten_capability() -> str:
    """The CPU kernel level ATen dispatches at in this process (``torch.backends.cpu.get_cpu_capability()``,
    upper case: "AVX512", "AVX2", "DEFAULT", ...; ``ATEN_CPU_CAPABILITY`` can lower it below what the CPU
    has); "" when torch cannot say."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    try:
        return str(get()).strip().upper() if get is not None else ""
    except RuntimeError:
        return ""


def amx_below_avx512(ctx: SelectionContext) -> Reason | None:
    """torch's CPU flash attention in bfloat16 packs its blocks for AMX when the CPU has ``amx_bf16``, and
    that packing (``pack_vnni2``) raises on some shapes when ATen dispatches below AVX-512
    (``ATEN_CPU_CAPABILITY=avx2`` / ``default`` on such a CPU; torch 2.13.0+cpu): the reason a kernel that
    runs SDPA on bfloat16 CPU inputs gives for refusing them there, else None."""
    cap = aten_capability()
    if (
        ctx.device.device_type == "cpu"
        and ctx.dtype is torch.bfloat16
        and "amx_bf16" in ctx.device.cpu_isa
        and cap in ("AVX2", "DEFAULT", "NO AVX")
    ):
        return Reason(
            ReasonCode.PLATFORM_UNSUPPORTED,
            f"bfloat16 CPU flash packs for AMX on this CPU (amx_bf16) but ATen dispatches at {cap} here "
            "(ATEN_CPU_CAPABILITY), where that packing raises 'pack_vnni2 is only supported when avx512 "
            "is supported'",
        )
    return None


def _flash_device_check(ctx: SelectionContext) -> list[Reason]:
    """Device-specific rules of the flash kernel: CUDA is fp16/bf16 without masks; CPU has no dropout, nor
    bfloat16 on an AMX CPU whose ATen dispatch is forced below AVX-512 (:func:`amx_below_avx512`; with ALiBi
    the kernel runs in float32, unaffected)."""
    out = _flash_check(ctx)
    if ctx.device.device_type == "cuda":
        if ctx.dtype not in HALF:
            out.append(Reason(ReasonCode.DTYPE_UNSUPPORTED, "CUDA flash needs float16 or bfloat16"))
        if ctx.mask is not MaskKind.NONE:
            out.append(Reason(ReasonCode.MASK_UNSUPPORTED, "CUDA flash does not take attn_mask"))
        if ctx.has_alibi:  # ALiBi is served as a float32 bias mask here, which CUDA flash cannot take
            out.append(
                Reason(
                    ReasonCode.ALIBI_UNSUPPORTED,
                    "CUDA flash takes no bias (ALiBi needs an attn_mask here; flash_attn2 has it natively)",
                )
            )
        if max(ctx.head_dim or 0, ctx.head_dim_v or 0) > 256:
            out.append(Reason(ReasonCode.HEAD_DIM_TOO_LARGE, "CUDA flash supports head_dim <= 256"))
    else:
        if ctx.dropout:
            out.append(
                Reason(ReasonCode.DROPOUT_UNSUPPORTED, "the CPU flash kernel does not support dropout")
            )
        amx = None if ctx.has_alibi else amx_below_avx512(ctx)
        if amx is not None:
            out.append(amx)
    return out
