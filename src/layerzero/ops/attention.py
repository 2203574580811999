"""``lz.attention``: scaled dot-product attention dispatched to the best kernel for these inputs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.compiler import is_dynamo_compiling, is_exporting

from layerzero.core.constraints import native_layout
from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import MISS
from layerzero.core.observers import OBSERVERS
from layerzero.core.opdef import OpDef, define
from layerzero.core.runtime import RUNTIME
from layerzero.core.specs import KernelSpec, Layout, MaskKind, OperationSpec
from layerzero.custom_ops import traced

from ._common import (
    FLOAT_DTYPES,
    check_same,
    check_tensor,
    deterministic_enabled,
    device_spec,
    fail,
    inference_only,
    is_grad_enabled,
    scope_layers,
    scope_token_of,
    stream_capturing,
)

OP = "attention"
_TENSOR = torch.Tensor
_ZERO_OK = (
    float,
    int,
)  # plain Python numbers only on the fast path (bool, numpy, tensors take the full checks)
_LAYOUTS = {"BHSD": Layout.BHSD, "BSHD": Layout.BSHD, Layout.BHSD: Layout.BHSD, Layout.BSHD: Layout.BSHD}


class AttentionKey(NamedTuple):
    """The selection-cache key of one ``lz.attention`` call: everything selection may depend on, named as the
    :class:`SelectionContext` fields that :func:`context` fills from it (lengths and batch bucketed to powers
    of two, :func:`~layerzero.core.context.bucket`). ``capture`` (a CUDA graph is being captured) and
    ``scope`` (the scoped-policy token) close every op's key; ``core.dispatch.capture_key`` flips
    ``capture``."""

    op: str
    device: torch.device
    dtype: torch.dtype
    batch: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    head_dim_v: int
    seq_len_q: int
    seq_len_kv: int
    seq_equal: bool
    layout: Layout
    mask: MaskKind
    is_causal: bool
    dropout: bool
    scale_default: bool
    stride_last_1: bool
    aligned_16: bool
    contiguous: bool
    requires_grad: bool
    deterministic: bool
    window_left: int | None
    window_right: int | None
    has_softcap: bool | None
    has_alibi: bool | None
    capture: bool
    scope: tuple[Any, ...]


def aligned_16(*tensors: torch.Tensor) -> bool:
    """Every tensor's data pointer and the strides of its non-last dims (of size > 1) are multiples of 16
    bytes, as the fused CUDA attention kernels load rows with 16-byte vector instructions (slices of wider
    tensors break it). A head dim that is not a multiple of 16 bytes counts as aligned: SDPA pads it,
    copying into fresh aligned memory."""
    for t in tensors:
        size = t.element_size()
        if (t.shape[-1] * size) % 16:
            continue
        if t.data_ptr() % 16 or any(
            (st * size) % 16 for st, n in zip(t.stride()[:-1], t.shape[:-1], strict=True) if n > 1
        ):
            return False
    return True


def _aligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, contiguous: bool) -> bool:
    """:func:`aligned_16` of q, k, v, answered without the stride walk for contiguous tensors at offset 0
    (the caching allocator's blocks are 512-byte aligned)."""
    return (
        contiguous and not (q.storage_offset() or k.storage_offset() or v.storage_offset())
    ) or aligned_16(q, k, v)


def _mask_kind(
    op: str, mask: Any, q: torch.Tensor, b: int, hq: int, sq: int, sk: int
) -> tuple[MaskKind, torch.Tensor | None]:
    """Validate ``attn_mask`` and canonicalize it: ``(kind, mask)`` where a mask of rank < 4 (broadcastable to
    ``[B, Hq, Sq, Sk]``, e.g. a key-padding mask ``[Sk]`` or ``[Sq, Sk]``) becomes a free 4-D view with
    leading 1s, so every kernel sees ``[B|1, Hq|1, Sq|1, Sk]`` (some, like SDPA's fused kernels, index dims -2
    and -4)."""
    if mask is None:
        return MaskKind.NONE, None
    if not isinstance(mask, torch.Tensor):
        raise fail(op, "attn_mask", "a torch.Tensor or None", type(mask).__name__)
    if mask.device != q.device:
        raise fail(op, "attn_mask.device", q.device, mask.device, "Move the mask to the query's device.")
    if mask.dtype == torch.bool:
        kind = MaskKind.BOOL
    elif mask.dtype == q.dtype:
        kind = MaskKind.FLOAT
    else:
        raise fail(
            op,
            "attn_mask.dtype",
            f"torch.bool or the query dtype {q.dtype}",
            mask.dtype,
            "Pass a boolean mask (True = attend) or an additive mask in the query dtype.",
        )
    full = (b, hq, sq, sk)
    shape = tuple(mask.shape)
    if (
        mask.dim() > 4
        or mask.dim() == 0
        or any(m not in (1, f) for m, f in zip(shape[::-1], full[::-1], strict=False))
    ):
        raise fail(
            op,
            "attn_mask shape",
            f"broadcastable to [B, Hq, Sq, Sk] = {list(full)}",
            list(shape),
            "Give the mask shape [B or 1, Hq or 1, Sq, Sk].",
        )
    if mask.dim() < 4:
        mask = mask.view((1,) * (4 - mask.dim()) + shape)
    return kind, mask


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


def _validate(
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
) -> tuple[Any, ...]:
    """The full checks (masks, scale, dropout, window, softcap, every error message). Returns the facts the
    key is built from: ``(layout, B, Hq, Hkv, D, Dv, Sq, Sk, mask kind, attn_mask, softcap)`` (the mask as the
    kernels get it, the softcap as a float or None); raises :class:`InvalidInputError`."""
    check_tensor(OP, "q", q, 4)
    check_tensor(OP, "k", k, 4)
    check_tensor(OP, "v", v, 4)
    check_same(OP, "q", q, "k", k)
    check_same(OP, "q", q, "v", v)
    lay = _LAYOUTS.get(layout) if isinstance(layout, (str, Layout)) else None
    if lay is None:
        raise fail(
            OP,
            "layout",
            "'BHSD' ([B, H, S, D], like SDPA) or 'BSHD' ([B, S, H, D], like flash-attn)",
            repr(layout),
            "LayerZero never guesses the layout: pass it explicitly.",
        )
    if lay is Layout.BHSD:
        b, hq, sq, d = q.shape
        bk, hkv, sk, dk = k.shape
        bv, hv, sv, dv = v.shape
    else:
        b, sq, hq, d = q.shape
        bk, sk, hkv, dk = k.shape
        bv, sv, hv, dv = v.shape
    if not b == bk == bv:
        raise fail(OP, "batch size", f"equal in q, k, v ({b})", f"k: {bk}, v: {bv}")
    if hkv != hv or sk != sv:
        raise fail(
            OP,
            "k/v shapes",
            "k and v with the same heads and sequence length",
            f"k {tuple(k.shape)}, v {tuple(v.shape)} ({lay.value})",
        )
    if dk != d:
        raise fail(OP, "head_dim of k", f"equal to q's head_dim {d}", dk)
    if hkv == 0 or hq % hkv:
        raise fail(
            OP,
            "heads",
            "Hq divisible by Hkv (GQA/MQA)",
            f"Hq={hq}, Hkv={hkv}",
            "Check the head dimension position for this layout.",
        )
    if sq == 0 or sk == 0 or b == 0 or d == 0 or dv == 0:
        raise fail(
            OP,
            "sizes",
            "non-empty batch, sequences and head dims",
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}",
        )
    if is_causal is not True and is_causal is not False:
        raise fail(OP, "is_causal", "a bool", repr(is_causal))
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise fail(OP, "dropout_p", "a float in [0, 1)", repr(dropout_p))
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise fail(OP, "scale", "None or a finite float > 0", repr(scale))
    mask, attn_mask = _mask_kind(OP, attn_mask, q, b, hq, sq, sk)
    _window(window, is_causal, sq, sk)  # raises for a bad window (the caller normalizes it again)
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        raise fail(OP, "softcap", "None (off) or a finite float > 0 (Gemma 2 uses 50.0)", repr(softcap))
    return lay, b, hq, hkv, d, dv, sq, sk, mask, attn_mask, None if softcap is None else float(softcap)


def _alibi(slopes: Any, q: torch.Tensor, b: int, hq: int) -> None:
    """Validate ``alibi_slopes``: a float32 tensor ``[Hq]`` or ``[B, Hq]`` on q's device (flash-attn's
    ``alibi_slopes`` contract; no silent upcast, so every kernel sees the same float32 slopes).

    Raises:
        InvalidInputError: not a tensor, wrong dtype, shape or device.
    """
    if not isinstance(slopes, torch.Tensor):
        raise fail(
            OP, "alibi_slopes", "None or a float32 torch.Tensor [Hq] or [B, Hq]", type(slopes).__name__
        )
    if slopes.dtype != torch.float32:
        raise fail(
            OP,
            "alibi_slopes.dtype",
            "torch.float32",
            slopes.dtype,
            "Pass float32 slopes as flash-attn requires: alibi_slopes.float().",
        )
    if tuple(slopes.shape) not in ((hq,), (b, hq)):
        raise fail(
            OP,
            "alibi_slopes shape",
            f"[Hq] = [{hq}] or [B, Hq] = [{b}, {hq}] (one slope per query head)",
            list(slopes.shape),
            "ALiBi slopes are per query head (Press et al. 2022: 2**(-8 h / Hq)).",
        )
    if slopes.device != q.device:
        raise fail(
            OP, "alibi_slopes.device", q.device, slopes.device, "Move them with alibi_slopes.to(q.device)."
        )


def _window(window: Any, is_causal: bool, sq: int, sk: int) -> tuple[int, int] | None:
    """Validate ``window`` and normalize it: ``(left, right)`` with -1 where a side does not restrict these
    lengths (``left >= Sq - 1``, ``right >= Sk - 1``); under ``is_causal`` ``right`` is 0 (causality bounds
    it). None when the window restricts nothing beyond ``is_causal`` (then every kernel can serve the call).

    Raises:
        InvalidInputError: ``window`` is not None or a pair of (int >= -1 or None).
    """
    if window is None:
        return None
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < -1) for w in window)
    ):
        raise fail(
            OP,
            "window",
            "None or (left, right): each side an int >= 0, or None for unbounded (-1 is "
            "accepted too: FlashAttention's window_size spelling)",
            repr(window),
            "Mistral-style causal sliding window W: window=(W - 1, 0) with is_causal=True.",
        )
    left, right = (-1 if w is None else int(w) for w in window)
    if left >= sq - 1:
        left = -1
    if is_causal:
        return None if left == -1 else (left, 0)
    if right >= sk - 1:
        right = -1
    return None if left == -1 and right == -1 else (left, right)


def context(key: AttentionKey) -> SelectionContext:
    """The :class:`SelectionContext` of an attention cache key."""
    return SelectionContext(
        op=OP,
        device=device_spec(key.device),
        dtype=key.dtype,
        batch=key.batch,
        num_heads_q=key.num_heads_q,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        head_dim_v=key.head_dim_v,
        seq_len_q=key.seq_len_q,
        seq_len_kv=key.seq_len_kv,
        seq_equal=key.seq_equal,
        layout=key.layout,
        mask=key.mask,
        is_causal=key.is_causal,
        dropout=key.dropout,
        scale_default=key.scale_default,
        stride_last_1=key.stride_last_1,
        aligned_16=key.aligned_16,
        contiguous=key.contiguous,
        requires_grad=key.requires_grad,
        deterministic=key.deterministic,
        graph_capture=key.capture,
        window_left=key.window_left,
        window_right=key.window_right,
        has_softcap=key.has_softcap,
        has_alibi=key.has_alibi,
    )


def _transposed(fn):
    """BSHD <-> BHSD is one swap of dims 1 and 2 either way: views in, view of the output back."""

    def call(
        q, k, v, *rest
    ):  # rest: attn_mask, is_causal, scale, dropout_p[, window, softcap[, alibi_slopes]]
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), *rest)
        return out.transpose(1, 2)

    return call


def adapter(spec: KernelSpec, ctx: SelectionContext, fn: Callable[..., Any]):
    """Call ``fn`` (``spec``'s callable) in its native layout: transpose q/k/v (views) and the output back
    when the input layout differs."""
    native = native_layout(spec, ctx.layout)
    if native is ctx.layout or native is None:
        return fn, (), 0.0
    return _transposed(fn), (f"{ctx.layout.value}->{native.value} (transpose views)",), 1.0


def capture_variants(key: AttentionKey) -> tuple[AttentionKey, ...]:
    """The capture-time keys of a causal, unmasked call with Sq == Sk that tracers make instead while a CUDA
    graph is being captured: the same call with the causal mask materialized as a bool mask
    (``is_causal=False``). transformers does that under capture (it cannot check position ids / padding
    without reading them), so a patched model's captured forward finds its choice prepared by its eager
    calls."""
    if key.mask is not MaskKind.NONE or not key.is_causal or not key.seq_equal:
        return ()
    fields = key._asdict()
    fields.update(mask=MaskKind.BOOL, is_causal=False)
    return (AttentionKey(**fields),)


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
