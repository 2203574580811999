"""The FlashAttention 2 / 3 / 4 attention kernels: callables and constraints as data.

Every kernel takes the canonical attention arguments ``q, k, v, attn_mask, is_causal, scale, dropout_p`` in
its native layout BSHD (q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` -> out ``[B, Sq, Hq, Dv]``, fp16/bf16,
CUDA); ``lz.attention``'s adapter transposes BHSD inputs (views) and charges the transform in the score.

Constraints and their sources (checked against the libraries' own Python checks):

- FA2 (``flash_attn/flash_attn_interface.py``, ``csrc/flash_attn/flash_api.cpp``, README): SM 8.0+ (Ampere,
  Ada, Hopper; Turing is FlashAttention-1 only), fp16/bf16, q/k/v head dims equal and <= 256 (non-multiples
  of 8 are padded by a copy in the wrapper, so we claim multiples of 8 only), GQA/MQA, dropout, no
  arbitrary mask, causal aligned bottom-right; backward with head_dim > 192 and dropout needs SM 8.0/9.0.
  ``sm_max`` 12.1 like torch's own FA2 copy (``torch_sdpa.flash``): an unknown future SM is not claimed.
- FA3 (``hopper/flash_attn_interface.py``, ``hopper/setup.py``): Hopper (SM 9.x) only, fp16/bf16 (fp8 is not
  an lz.attention dtype), head dims compiled for {64, 96, 128, 192, 256} (conservative: other multiples of 8
  are rounded up to those instantiations inside FA3), no dropout, returns ``out`` or ``(out, lse)`` depending
  on the release (both handled).
- FA4 (``flash_attn/cute/interface.py``): Blackwell SM 10.x-11.0 (the SM100 path; SM 12.x consumer parts run
  a different, newer path we do not claim), fp16/bf16, (D, Dv) in {(64,64), (96,96), (128,128), (192,128)},
  no dropout, returns ``(out, lse)``; kernels are JIT-compiled by the CuTe DSL on the first call of each
  compile key, so FA4 is not graph-safe; its backward is not deterministic.

All three: FlashAttention's causal mask is aligned to the bottom-right corner when Sq != Sk, while
``lz.attention`` (like SDPA) aligns it top-left, so causal calls with Sq != Sk are refused with
``CAUSAL_SEQ_MISMATCH``; stride(-1) == 1 and 16-byte aligned rows are required.

Sliding window and soft-cap (``lz.attention(window=, softcap=)``): passed as ``window_size=(left, right)``
(FA2/FA3: -1 = unbounded; FA4: None = unbounded) and ``softcap=`` (FA2 >= 2.6, FA3, FA4; the kwargs are only
passed when set, so older FA2 builds keep working for plain calls). FA aligns the window bottom-right like its
causal mask, so a window with Sq != Sk is refused with ``SLIDING_WINDOW_UNSUPPORTED``.

ALiBi (``lz.attention(alibi_slopes=)``): only FA2's ``flash_attn_func`` has ``alibi_slopes`` (float32 ``[Hq]``
or ``[B, Hq]``, bias ``-slope * |i + Sk - Sq - j|``, the convention lz.attention follows, so Sq != Sk agrees
too); FA3 (``hopper/flash_attn_interface.py``) and FA4 (``flash_attn/cute/interface.py``) have no such
argument and are refused with ``ALIBI_UNSUPPORTED``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerzero.core.context import SelectionContext
from layerzero.core.device import GPUGeneration
from layerzero.core.errors import BackendNotAvailableError
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Layout, MaskKind

from .detect import LIBRARIES, FlashVersion

R = ReasonCode
HALF = frozenset({torch.float16, torch.bfloat16})
BSHD = frozenset({Layout.BSHD})
NO_MASK = frozenset({MaskKind.NONE})
CUDA = frozenset({"cuda"})

FA3_HEAD_DIMS = (64, 96, 128, 192, 256)
FA4_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128))

PRIORITY = {FlashVersion.FA2: 90, FlashVersion.FA3: 95, FlashVersion.FA4: 96}
"""Above every torch_sdpa kernel (cuDNN 85): FA4 > FA3 > FA2, each only where its hardware rules allow."""

KERNEL_IDS = {v: f"{v.value}.attention" for v in FlashVersion}


def _causal_check_only(ctx: SelectionContext) -> list[Reason]:
    if ctx.is_causal and not ctx.seq_equal:
        return [
            Reason(
                R.CAUSAL_SEQ_MISMATCH,
                "FlashAttention aligns the causal mask bottom-right when Sq != Sk (query i sees keys "
                "j <= i + Sk - Sq), lz.attention aligns it top-left like SDPA (j <= i); "
                "the results would differ",
            )
        ]
    return []


def _window_check(ctx: SelectionContext) -> list[Reason]:
    if ctx.window_left is not None and not ctx.seq_equal:
        return [
            Reason(
                R.SLIDING_WINDOW_UNSUPPORTED,
                "FlashAttention aligns the sliding window bottom-right when Sq != Sk (query i is at position "
                "i + Sk - Sq), lz.attention aligns it top-left like is_causal; the results would differ",
            )
        ]
    return []


def _causal_check(ctx: SelectionContext) -> list[Reason]:
    """Bottom-right vs top-left alignment: causal and sliding-window calls need Sq == Sk."""
    out = _causal_check_only(ctx)
    out.extend(_window_check(ctx))
    return out


def _fa2_check(ctx: SelectionContext) -> list[Reason]:
    out = _causal_check(ctx)
    big = max(ctx.head_dim or 0, ctx.head_dim_v or 0)
    if ctx.requires_grad and ctx.dropout and big > 192 and ctx.device.sm not in ((8, 0), (9, 0)):
        out.append(
            Reason(
                R.HEAD_DIM_TOO_LARGE,
                f"FA2 backward with dropout and head_dim {big} > 192 needs SM 8.0 or 9.0",
            )
        )
    return out


def _fa3_check(ctx: SelectionContext) -> list[Reason]:
    out = _causal_check(ctx)
    if ctx.head_dim is not None and ctx.head_dim not in FA3_HEAD_DIMS:
        out.append(Reason(R.HEAD_DIM_INVALID, f"FA3 head_dim {ctx.head_dim} not in {list(FA3_HEAD_DIMS)}"))
    return out


def _fa4_check(ctx: SelectionContext) -> list[Reason]:
    out = _causal_check(ctx)
    dims = (ctx.head_dim, ctx.head_dim_v if ctx.head_dim_v is not None else ctx.head_dim)
    if ctx.head_dim is not None and dims not in FA4_HEAD_DIMS:
        out.append(Reason(R.HEAD_DIM_INVALID, f"FA4 (D, Dv) = {dims} not in {list(FA4_HEAD_DIMS)}"))
    if ctx.deterministic and ctx.requires_grad:
        out.append(Reason(R.NON_DETERMINISTIC, "FA4's backward is not deterministic (atomic adds)"))
    return out


def _lse_bytes(ctx: SelectionContext) -> int:
    """The float32 softmax log-sum-exp every FA forward writes: ``[B, Hq, Sq]`` x 4 bytes (bucket bounds)."""
    return 4 * (ctx.batch or 0) * (ctx.num_heads_q or 0) * (ctx.seq_len_q or 0)


def _first(out: Any) -> torch.Tensor:
    """FA3/FA4 return ``out`` or ``(out, lse)`` depending on the release: the attention output either way."""
    return out[0] if isinstance(out, tuple) else out


def _local_kwargs(
    window: tuple[int, int] | None, softcap: float | None, unbounded: Any = -1
) -> dict[str, Any]:
    """``window_size=`` / ``softcap=`` kwargs for a FlashAttention call, only those that are set
    (``unbounded`` replaces -1: FA2/FA3 take -1, FA4 takes None)."""
    out: dict[str, Any] = {}
    if window is not None:
        out["window_size"] = tuple(unbounded if w < 0 else w for w in window)
    if softcap is not None:
        out["softcap"] = softcap
    return out


def fa2_call(func: Callable[..., Any], deterministic: bool = False) -> Callable[..., torch.Tensor]:
    """Wrap FA2's ``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1,
    -1), softcap=0.0, alibi_slopes=None, ..., deterministic=False)`` as a canonical attention kernel (BSHD
    tensors, returns ``[B, Sq, Hq, D]``; window ``(left, right)`` tokens and softcap passed only when set).
    ``deterministic=True`` asks for FA2's deterministic backward (used in torch deterministic mode)."""
    extra = {"deterministic": True} if deterministic else {}

    def run(q, k, v, attn_mask, is_causal, scale, dropout_p, window=None, softcap=None, alibi_slopes=None):
        if alibi_slopes is not None:  # passed only when set: FA2 < 2.4 has no alibi_slopes
            extra_alibi = {"alibi_slopes": alibi_slopes}
        else:
            extra_alibi = {}
        return func(
            q,
            k,
            v,
            dropout_p,
            softmax_scale=scale,
            causal=is_causal,
            **extra,
            **extra_alibi,
            **_local_kwargs(window, softcap),
        )

    run.__name__ = "flash_attn2_func"
    return run


def fa3_call(func: Callable[..., Any], deterministic: bool = False) -> Callable[..., torch.Tensor]:
    """Wrap FA3's ``flash_attn_func(q, k, v, softmax_scale=None, causal=False, ..., window_size=(-1, -1), ...,
    softcap=0.0, ..., deterministic=False)`` (returns ``out`` or ``(out, lse)``) as a canonical attention
    kernel (BSHD; no dropout, no mask; window and softcap passed only when set)."""
    extra = {"deterministic": True} if deterministic else {}

    def run(q, k, v, attn_mask, is_causal, scale, dropout_p, window=None, softcap=None):
        return _first(
            func(q, k, v, softmax_scale=scale, causal=is_causal, **extra, **_local_kwargs(window, softcap))
        )

    run.__name__ = "flash_attn3_func"
    return run


def fa4_call(func: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """Wrap FA4's ``flash_attn.cute.flash_attn_func(q, k, v, softmax_scale=None, causal=False,
    window_size=(None, None), ..., softcap=0.0, ...)`` (returns ``(out, lse)``) as a canonical attention
    kernel (BSHD; no dropout, no mask; window sides of -1 become None, passed only when set)."""

    def run(q, k, v, attn_mask, is_causal, scale, dropout_p, window=None, softcap=None):
        return _first(
            func(
                q,
                k,
                v,
                softmax_scale=scale,
                causal=is_causal,
                **_local_kwargs(window, softcap, unbounded=None),
            )
        )

    run.__name__ = "flash_attn4_func"
    return run


def _missing(which: FlashVersion) -> Callable[..., Any]:
    """The callable of a kernel whose library is absent; selection never picks it (its backend is
    unavailable), so reaching it means someone called the spec's ``fn`` directly."""
    info = LIBRARIES[which]

    def run(*args: Any) -> Any:
        raise BackendNotAvailableError(
            f"{KERNEL_IDS[which]} cannot run: module {info.module!r} is not available. "
            f"Install it ({info.install_hint}) or let lz.attention pick another kernel."
        )

    return run


def _deterministic_variant(make: Callable[..., Callable[..., Any]], func: Callable[..., Any] | None):
    """``specialize`` hook: the deterministic-backward call when torch deterministic mode is on and autograd
    records the call; None (use ``fn``) otherwise."""
    if func is None:
        return None
    det = make(func, deterministic=True)

    def pick(ctx: SelectionContext) -> Callable[..., Any] | None:
        return det if ctx.deterministic and ctx.requires_grad else None

    return pick


def kernel_specs(functions: dict[FlashVersion, Callable[..., Any] | None]) -> list[KernelSpec]:
    """The three FlashAttention KernelSpecs.

    Args:
        functions: each library's ``flash_attn_func`` (from :func:`detect.probe`), or None when missing; a
            missing one still gets its spec (its backend is registered unavailable) with a callable that
            raises ``BackendNotAvailableError``.

    Returns:
        ``[flash_attn2.attention, flash_attn3.attention, flash_attn4.attention]``.
    """
    fa2, fa3, fa4 = (functions.get(v) for v in FlashVersion)
    common: dict[str, Any] = dict(
        device_types=CUDA,
        dtypes=HALF,
        layouts=BSHD,
        supports_gqa=True,
        mask_kinds=NO_MASK,
        mask_with_causal=False,
        supports_causal=True,
        supports_window=True,
        supports_softcap=True,
        requires_stride_last_1=True,
        requires_aligned_16=True,
        supports_backward=True,
        workspace=_lse_bytes,
    )
    return [
        KernelSpec(
            KERNEL_IDS[FlashVersion.FA2],
            "attention",
            fa2_call(fa2) if fa2 else _missing(FlashVersion.FA2),
            priority=PRIORITY[FlashVersion.FA2],
            description="FlashAttention-2 flash_attn_func (SM 8.0-12.1, fp16/bf16, BSHD, GQA, dropout)",
            sm_min=(8, 0),
            sm_max=(12, 1),
            head_dim_max=256,
            head_dim_multiple=8,
            head_dims_equal=True,
            supports_dropout=True,
            supports_alibi=True,
            deterministic=True,
            graph_safe=True,
            check=_fa2_check,
            specialize=_deterministic_variant(fa2_call, fa2),
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[FlashVersion.FA3],
            "attention",
            fa3_call(fa3) if fa3 else _missing(FlashVersion.FA3),
            priority=PRIORITY[FlashVersion.FA3],
            description="FlashAttention-3 flash_attn_func (Hopper SM 9.x, fp16/bf16, BSHD, GQA, no dropout)",
            generations=frozenset({GPUGeneration.HOPPER}),
            head_dim_max=256,
            head_dim_multiple=8,
            head_dims_equal=True,
            supports_dropout=False,
            deterministic=True,
            graph_safe=True,
            check=_fa3_check,
            specialize=_deterministic_variant(fa3_call, fa3),
            **common,
        ),
        KernelSpec(
            KERNEL_IDS[FlashVersion.FA4],
            "attention",
            fa4_call(fa4) if fa4 else _missing(FlashVersion.FA4),
            priority=PRIORITY[FlashVersion.FA4],
            description="FlashAttention-4 CuTe DSL (Blackwell SM 10.0-11.0, fp16/bf16, BSHD, GQA, "
            "JIT-compiled)",
            generations=frozenset({GPUGeneration.BLACKWELL}),
            sm_min=(10, 0),
            sm_max=(11, 0),
            head_dim_max=192,
            head_dim_multiple=8,
            supports_dropout=False,
            deterministic=True,
            graph_safe=False,
            check=_fa4_check,
            **common,
        ),
    ]
