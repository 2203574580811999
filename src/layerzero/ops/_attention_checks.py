"""The full checks of ``lz.attention`` (what its fast path does not prove): :func:`_validate` (ranks, dtypes,
devices, layout, shapes, ``is_causal``, ``dropout_p``, ``scale``, ``softcap``), the mask check and
canonicalization (:func:`_mask_kind`), ALiBi slopes (:func:`_alibi`), the sliding window (:func:`_window`) and
the 16-byte alignment test of the fused kernels (:func:`aligned_16`). Its own module so that
:mod:`layerzero.ops.attention` (which re-exports every name here) holds the op's key building and its hot
path; the op's contract is documented there."""

from __future__ import annotations

import math
from typing import Any

import torch

from layerzero.core.specs import Layout, MaskKind

from ._common import check_same, check_tensor, fail

OP = "attention"
_LAYOUTS = {"BHSD": Layout.BHSD, "BSHD": Layout.BSHD, Layout.BHSD: Layout.BHSD, Layout.BSHD: Layout.BSHD}


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
