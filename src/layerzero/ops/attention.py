"""``lz.attention``: scaled dot-product attention dispatched to the best kernel for these inputs.

This module holds the op, its key building (:func:`prepare`, :func:`_prepare`) and its hot path; the full
checks live in :mod:`layerzero.ops._attention_checks` and the key, context, layout adapter and capture
variants in :mod:`layerzero.ops._attention_select`, both re-exported here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.dispatch import MISS
from layerzero.core.observers import OBSERVERS
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import Layout, MaskKind, OperationSpec
from layerzero.custom_ops import traced

from ._attention_checks import (  # noqa: F401 - re-exported
    _LAYOUTS,
    OP,
    _alibi,
    _aligned,
    _mask_kind,
    _validate,
    _window,
    aligned_16,
)
from ._attention_select import (  # noqa: F401 - re-exported
    AttentionKey,
    _transposed,
    adapter,
    capture_variants,
    context,
)
from ._common import (
    FLOAT_DTYPES,
    deterministic_enabled,
    inference_only,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
)

_TENSOR = torch.Tensor
_ZERO_OK = (
    float,
    int,
)  # plain Python numbers only on the fast path (bool, numpy, tensors take the full checks)


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    layout: str | Layout = "BHSD",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Validate ``lz.attention`` inputs; return (cache key, canonical kernel args).

    The canonical args are ``(q, k, v, attn_mask, is_causal, scale, dropout_p)``, plus ``(window, softcap)``
    when a (normalized, non-trivial) window or a soft-cap is set: only kernels declaring ``supports_window`` /
    ``supports_softcap`` are then eligible, and they accept the two extra arguments. With ``alibi_slopes`` the
    args are ``(..., window, softcap, alibi_slopes)`` (window/softcap possibly None): only kernels declaring
    ``supports_alibi`` are eligible."""
    key, args = _prepare(
        q, k, v, attn_mask, is_causal, scale, dropout_p, layout, window, softcap, alibi_slopes
    )
    return AttentionKey(*key), args


def _prepare(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any,
    is_causal: Any,
    scale: Any,
    dropout_p: Any,
    layout: Any,
    window: Any = None,
    softcap: Any = None,
    alibi_slopes: Any = None,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """:func:`prepare` with positional arguments (the hot path). The happy path is a handful of attribute
    reads; anything unusual goes to :func:`_validate`, which raises the precise :class:`InvalidInputError`.
    The key is the plain tuple of the :class:`AttentionKey` fields (equal to it and hashed alike; ~0.7 µs
    cheaper to build): dispatch names it on a miss (``Runtime.named_key``)."""
    lay = _LAYOUTS.get(layout) if layout.__class__ is str or isinstance(layout, Layout) else None
    try:
        dtype, device = q.dtype, q.device
        qs, ks, vs = q.shape, k.shape, v.shape
        fast = (
            q.__class__ is _TENSOR
            and k.__class__ is _TENSOR
            and v.__class__ is _TENSOR
            and lay is not None
            and len(qs) == 4
            and len(ks) == 4
            and len(vs) == 4
            and dtype in FLOAT_DTYPES
            and k.dtype is dtype
            and v.dtype is dtype
            and k.device == device
            and v.device == device
            and (is_causal is True or is_causal is False)
            and attn_mask is None
            and scale is None
            and dropout_p.__class__ in _ZERO_OK
            and dropout_p == 0
            and (window is None or window.__class__ is tuple)
            and (softcap is None or (softcap.__class__ is float and 0.0 < softcap < math.inf))
        )
    except AttributeError:
        fast = False
    if fast:
        if lay is Layout.BHSD:
            b, hq, sq, d = qs
            bk, hkv, sk, dk = ks
            bv, hv, sv, dv = vs
        else:
            b, sq, hq, d = qs
            bk, sk, hkv, dk = ks
            bv, sv, hv, dv = vs
        fast = bool(
            b == bk == bv
            and hkv == hv
            and sk == sv
            and dk == d
            and hkv
            and not hq % hkv
            and sq
            and sk
            and b
            and d
            and dv
        )
        mask = MaskKind.NONE
    if not fast:
        lay, b, hq, hkv, d, dv, sq, sk, mask, attn_mask, softcap = _validate(
            q, k, v, attn_mask, is_causal, scale, dropout_p, layout, window, softcap
        )
        dtype, device = q.dtype, q.device
    if alibi_slopes is not None:
        _alibi(alibi_slopes, q, b, hq)
    contiguous = q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    stride = contiguous or (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)
    grad = is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    cuda = q.is_cuda
    capture = cuda and stream_capturing()
    aligned = not cuda or _aligned(q, k, v, contiguous)
    # window/softcap (the Mistral / Gemma 2 calls of the HF integration) stay on the fast path: _window
    # validates
    win = None if window is None else _window(window, is_causal, sq, sk)
    layers = scope_layers()
    # lengths and batch bucketed to powers of two (core.context.bucket, inlined: three calls fewer per call)
    key = (
        OP,
        device,
        dtype,
        b if b <= 1 else 1 << (b - 1).bit_length(),
        hq,
        hkv,
        d,
        dv,
        sq if sq <= 1 else 1 << (sq - 1).bit_length(),
        sk if sk <= 1 else 1 << (sk - 1).bit_length(),
        sq == sk,
        lay,
        mask,
        is_causal,
        dropout_p > 0.0,
        scale is None,
        stride,
        aligned,
        contiguous,
        grad,
        deterministic_enabled(),
        None if win is None else win[0],
        None if win is None else win[1],
        None if softcap is None else True,
        None if alibi_slopes is None else True,
        capture,
        scope_token_of(layers) if layers else (),
    )
    if alibi_slopes is not None:
        return key, (q, k, v, attn_mask, is_causal, scale, dropout_p, win, softcap, alibi_slopes)
    if win is None and softcap is None:
        return key, (q, k, v, attn_mask, is_causal, scale, dropout_p)
    return key, (q, k, v, attn_mask, is_causal, scale, dropout_p, win, softcap)


SPEC = OperationSpec(
    OP,
    "scaled dot-product attention (SDPA semantics, GQA, masks)",
    ("q", "k", "v"),
    "reference.attention",
    adapter,
    capture_variants,
    AttentionKey,
)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    layout: str = "BHSD",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention ``softmax(q k^T * scale + mask) v`` (Vaswani et al. 2017), dispatched to
    the fastest eligible kernel (SDPA flash / cuDNN / efficient / math, reference; more in later backends).

    Shapes (B batch, Hq query heads, Hkv key/value heads, Sq/Sk query/key length in tokens, D head dim,
    Dv value head dim), never guessed — ``layout`` says which:

    - ``"BHSD"`` (like ``F.scaled_dot_product_attention``): q ``[B, Hq, Sq, D]``, k ``[B, Hkv, Sk, D]``,
      v ``[B, Hkv, Sk, Dv]`` -> ``[B, Hq, Sq, Dv]``.
    - ``"BSHD"`` (like flash-attn): q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` -> ``[B, Sq, Hq, Dv]``.

    dtype: float32, float64, float16 or bfloat16, the same for q, k, v; output has it too.
    GQA/MQA: ``Hq % Hkv == 0``; KV head j serves query heads ``j*Hq/Hkv ... (j+1)*Hq/Hkv - 1`` (no repeat
    needed). ``attn_mask``: bool (True = attend) or additive float in q's dtype, broadcastable to
    ``[B, Hq, Sq, Sk]``. ``is_causal``: query i attends keys ``j <= i`` (top-left aligned, as SDPA, when
    Sq != Sk). A row whose keys are all masked returns 0. ``scale``: default ``1/sqrt(D)``.
    ``dropout_p``: probability in [0, 1) applied to the attention weights.

    ``window=(left, right)``: local (sliding-window) attention, FlashAttention's ``window_size`` convention
    (Beltagy et al. 2020; Mistral): query i attends keys j with ``i - left <= j <= i + right``, None =
    unbounded on that side (FlashAttention's -1 is accepted too), positions top-left aligned exactly like
    ``is_causal`` (query i at position i, key j at j). With ``is_causal=True`` right is effectively 0
    (Mistral's window W is ``window=(W - 1, 0)``). Combines with ``attn_mask`` (a key must pass every one). A
    window that restricts nothing for these lengths is dropped, so any kernel can serve the call. ``softcap``:
    logit soft-capping (Gemma 2): ``scores = softcap * tanh(scores / softcap)`` on the scaled scores, before
    mask, causality and window; None = off. Served only by kernels that declare them (reference,
    flex_attention, flash_attn2/3/4 — a window there needs Sq == Sk — and, for calls with ``alibi_slopes``,
    ``triton.attention``); the others are refused with ``SLIDING_WINDOW_UNSUPPORTED`` /
    ``SOFTCAP_UNSUPPORTED``.

    ``alibi_slopes``: ALiBi (Press et al. 2022), flash-attn's ``flash_attn_func(alibi_slopes=)`` convention
    exactly: float32 ``[Hq]`` or ``[B, Hq]`` (one slope per query head, per batch row for ``[B, Hq]``); the
    bias ``-slope[b, h] * |i + Sk - Sq - j|`` is added to the scaled (and soft-capped) score of query i and
    key j, before masks. Positions are aligned bottom-right (query i sits at position ``i + Sk - Sq``), as in
    flash-attn, whatever ``is_causal``; with Sq == Sk it is ``-slope * |i - j|``, and under causality
    (``j <= i``) it equals ``slope * (j - i)``, flash-attn's causal form. Served by kernels declaring
    ``supports_alibi`` (reference, flex_attention, flash_attn2, ``triton.attention`` on CUDA with the bias
    computed in the kernel, SDPA math and the CPU SDPA flash kernel through an explicit float32 bias); the
    others are refused with ``ALIBI_UNSUPPORTED``. Not float32, a shape other than ``[Hq]`` / ``[B, Hq]``, or
    another device than q raises ``InvalidInputError`` (no silent upcast).

    Under ``torch.compile`` / ``torch.export`` the call is one ``torch.ops.layerzero.attention`` node, also
    when inputs require grad (backward formula: ``layerzero/custom_ops/_grad.py``, SDPA's own backward without
    mask, window and soft-cap, else the reference kernel's gradients in float32, ALiBi included; a float
    ``attn_mask`` that requires grad gets one). Traced as Python instead: calls whose ``alibi_slopes`` require
    grad (the formula gives the slopes none) and calls with ``dropout_p > 0`` that need gradients (the dropout
    mask cannot be recomputed in the backward).

    Raises:
        InvalidInputError: wrong rank, dtype or device mix, batch/head/head_dim mismatch, ``Hq % Hkv != 0``,
            mask dtype or shape, ``dropout_p`` outside [0, 1), non-positive ``scale``, unknown ``layout``,
            ``window`` not a pair of (int >= -1 or None), ``softcap`` not a finite float > 0, ``alibi_slopes``
            not a float32 ``[Hq]`` / ``[B, Hq]`` tensor on q's device.
        NoKernelFoundError: the op is locked to a kernel that cannot run these inputs (message lists why).
        KernelExecutionError: the kernel failed and no fallback was allowed (lock or strict mode).

    >>> import torch, layerzero as lz
    >>> q = k = v = torch.randn(1, 8, 16, 64)
    >>> lz.attention(q, k, v, is_causal=True).shape
    torch.Size([1, 8, 16, 64])
    """
    if (
        (is_dynamo_compiling() or is_exporting())
        and inference_only(alibi_slopes)  # fixed slopes (no gradient)
        and (dropout_p == 0 or inference_only(q, k, v, attn_mask))
    ):  # one custom-op node (custom_ops/_ops.py)
        return traced("attention")(
            q, k, v, attn_mask, is_causal, scale, dropout_p, layout, window, softcap, alibi_slopes
        )
    hot_key = None
    if (
        attn_mask is None
        and scale is None
        and window is None
        and softcap is None
        and alibi_slopes is None
        and q.__class__ is _TENSOR
        and k.__class__ is _TENSOR
        and v.__class__ is _TENSOR
        and (is_causal is True or is_causal is False)
        and dropout_p.__class__ in _ZERO_OK
        and dropout_p == 0
        and (layout.__class__ is str or layout.__class__ is Layout)
    ):
        # the device as the exact key holds it (ops._common.exact_device, inlined in this hottest op): -1 for
        # the CPU, the index for CUDA; other devices take the full path
        if q.is_cpu:
            dev = -1 if k.is_cpu and v.is_cpu else None
        else:
            dev = q.get_device() if q.is_cuda and k.is_cuda and v.is_cuda else None
            if dev is not None and (k.get_device() != dev or v.get_device() != dev):
                dev = None
        dtype = q.dtype
        if dev is not None and k.dtype is dtype and v.dtype is dtype:
            # the exact key (Runtime.run_hot) holds the shapes as given, the dtype and the layout as passed
            # ("BHSD" and Layout.BHSD are equal and hash alike): only calls that passed every check file it,
            # so a hit skips the shape, dtype and layout checks and the bucketing. is_causal and dropout_p are
            # checked above (1 would match True in a key).
            contiguous = q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            cuda = dev >= 0
            layers = scope_layers()
            hot_key = (
                OP,
                dev,
                dtype,
                q.shape,
                k.shape,
                v.shape,
                layout,
                is_causal,
                contiguous,
                contiguous or (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1),
                not cuda or _aligned(q, k, v, contiguous),
                is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
                deterministic_enabled(),
                cuda and stream_capturing(),
                scope_token_of(layers) if layers else (),
            )
            if (
                OBSERVERS.none
            ):  # Runtime.run_hot inlined (core/observers.py says when that is allowed and why)
                plan = RUNTIME.cache.hot.get(hot_key)
                if plan is not None:
                    try:
                        return plan.call(q, k, v, None, is_causal, None, dropout_p)
                    except Exception as exc:  # noqa: BLE001 - recorded, then retried or re-raised as run_hot does
                        return RUNTIME.hot_failure(plan, exc, (q, k, v, None, is_causal, None, dropout_p))
            else:
                out = RUNTIME.run_hot(hot_key, (q, k, v, None, is_causal, None, dropout_p))
                if out is not MISS:
                    return out
    key, args = _prepare(
        q, k, v, attn_mask, is_causal, scale, dropout_p, layout, window, softcap, alibi_slopes
    )
    return RUNTIME.run(key, context, args, hot_key)


# the op(s) of this module, defined once (layerzero.core.opdef): every list of ops is derived from these
OPDEFS = define(
    OpDef(
        SPEC,
        attention,
        prepare,
        context,
        kernel_args=("q", "k", "v", "attn_mask", "is_causal", "scale", "dropout_p"),
        custom_ops=("attention",),
    ),
)
