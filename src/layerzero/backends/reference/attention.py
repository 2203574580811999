"""Reference scaled-dot-product attention: the oracle every attention kernel is tested against.

Plain PyTorch written for clarity, not speed: it materializes the whole ``[B, Hq, Sq, Sk]`` score
matrix. It computes in float32 (float64 when any input is float64) and returns ``q``'s dtype.
It follows ``torch.nn.functional.scaled_dot_product_attention`` (math backend) with two deliberate
extensions: a mask and ``is_causal`` may be combined, and fully masked query rows give 0, not NaN.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from layerzero.core.errors import InvalidInputError, expected_got

__all__ = ["attention"]

_LAYOUTS = ("BHSD", "BSHD")


def _layout_name(layout: Any) -> str:
    """``"BHSD"``/``"BSHD"`` from a string or a str-valued Enum member."""
    name = str(getattr(layout, "value", layout)).upper()
    if name not in _LAYOUTS:
        raise InvalidInputError(
            expected_got("reference.attention: layout", f"one of {list(_LAYOUTS)}", repr(layout),
                         "Use 'BHSD' for [B, H, S, D] tensors or 'BSHD' for [B, S, H, D].")
        )  # fmt: skip
    return name


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32."""
    return (
        torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    layout: str = "BHSD",
    generator: torch.Generator | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention, ``softmax(q k^T * scale + mask) v`` (Vaswani et al. 2017).

    Shapes (named dims: B batch, Hq query heads, Hkv key/value heads, Sq query length, Sk key length,
    D query/key head dim, Dv value head dim):

    - layout ``"BHSD"``: q ``[B, Hq, Sq, D]``, k ``[B, Hkv, Sk, D]``, v ``[B, Hkv, Sk, Dv]`` ->
      ``[B, Hq, Sq, Dv]``
    - layout ``"BSHD"``: q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]`` ->
      ``[B, Sq, Hq, Dv]``

    Semantics:

    - GQA / MQA: ``Hq % Hkv == 0``; kv head ``j`` serves the ``Hq // Hkv`` consecutive query heads
      ``j * (Hq // Hkv) ...`` (``repeat_interleave``, like SDPA ``enable_gqa=True``).
    - ``scale`` defaults to ``1 / sqrt(D)``.
    - ``attn_mask`` broadcastable to ``[B, Hq, Sq, Sk]``: bool (True = attend) or float (added to the
      scores, ``-inf`` masks out).
    - ``is_causal``: top-left aligned like torch SDPA, also when ``Sq != Sk``: query ``i`` attends keys
      ``j <= i`` (for decode-style bottom-right alignment pass an explicit mask instead).
    - Mask and ``is_causal`` together are combined (a key must pass both); SDPA refuses this, we allow it.
    - ``window=(left, right)`` (FlashAttention's ``window_size``): query ``i`` attends keys ``j`` with
      ``i - left <= j <= i + right``, -1 = unbounded on that side, top-left aligned like ``is_causal``;
      combined with the mask and causality (a key must pass all).
    - ``softcap`` (Gemma 2 logit soft-capping): ``scores = softcap * tanh(scores / softcap)`` on the scaled
      scores, before the additive mask, causality and window.
    - ``alibi_slopes`` (ALiBi, Press et al. 2022, flash-attn's ``alibi_slopes`` convention): ``[Hq]`` or
      ``[B, Hq]``; ``-slope[b, h] * |i + Sk - Sq - j|`` is added to the scaled (soft-capped) score of query
      ``i`` and key ``j`` (positions aligned bottom-right, as flash-attn), before the mask, causality and
      window.
    - A query row whose every key is masked outputs 0 (not NaN), whatever the mask kind.
    - ``dropout_p > 0`` zeroes each probability with chance ``dropout_p`` (drawn with ``torch.rand`` on
      ``generator`` when given) and scales survivors by ``1 / (1 - dropout_p)``; ``dropout_p >= 1`` gives 0.

    Args:
        q, k, v: float tensors as above (any float dtype; computed in float32, float64 if any is float64).
        attn_mask: optional bool or float mask, see above.
        is_causal: apply the top-left causal mask.
        scale: softmax scale (unitless); None for ``1 / sqrt(D)``.
        dropout_p: dropout probability on the attention weights, in [0, 1].
        layout: ``"BHSD"`` or ``"BSHD"`` (a str-valued Enum member is accepted too).
        generator: ``torch.Generator`` for the dropout draws; None uses the global RNG.
        window: ``(left, right)`` in tokens (ints >= -1), or None for no window.
        softcap: soft-cap value (> 0), or None for none.
        alibi_slopes: ALiBi slopes ``[Hq]`` or ``[B, Hq]`` (float32), or None for no ALiBi.

    Returns:
        The attention output in ``q``'s dtype and in the input ``layout`` (contiguous).

    Raises:
        InvalidInputError: ``layout`` is not ``"BHSD"``/``"BSHD"``. Other checks (shapes, GQA ratio,
        dtypes) are the ops layer's job; this oracle lets torch raise on inconsistent shapes.

    >>> q = torch.randn(1, 4, 3, 8); k = v = torch.randn(1, 2, 5, 8)
    >>> attention(q, k, v, is_causal=True).shape
    torch.Size([1, 4, 3, 8])
    """
    name = _layout_name(layout)
    out_dtype = q.dtype
    cdt = _compute_dtype(
        q, k, v, attn_mask if attn_mask is not None and attn_mask.is_floating_point() else None
    )
    if name == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B, Hq, Sq, Sk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        # distance of key j from query i, with query i at position i + Sk - Sq (bottom-right, as flash-attn)
        dist = (
            (
                torch.arange(sq, device=q.device)[:, None]
                + (sk - sq)
                - torch.arange(sk, device=q.device)[None, :]
            )
            .abs()
            .to(cdt)
        )  # [Sq, Sk]
        slopes = alibi_slopes.to(device=q.device, dtype=cdt)
        slopes = slopes[None, :] if slopes.dim() == 1 else slopes  # [1 or B, Hq]
        scores = scores - slopes[:, :, None, None] * dist  # [B, Hq, Sq, Sk]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = torch.tril(allowed)  # top-left: key j visible to query i iff j <= i
    if window is not None:
        offset = (
            torch.arange(sk, device=q.device)[None, :] - torch.arange(sq, device=q.device)[:, None]
        )  # j - i
        left, right = window
        if left >= 0:
            allowed = allowed & (offset >= -left)
        if right >= 0:
            allowed = allowed & (offset <= right)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask.to(q.device)
        else:
            scores = scores + attn_mask.to(device=q.device, dtype=cdt)
    scores = scores.masked_fill(~allowed, float("-inf"))

    # Numerically safe softmax whose fully masked rows (max == -inf) come out as all zeros.
    row_max = scores.amax(dim=-1, keepdim=True)
    dead = torch.isneginf(row_max)
    weights = torch.exp(scores - torch.where(dead, torch.zeros_like(row_max), row_max))
    denom = weights.sum(dim=-1, keepdim=True)
    probs = torch.where(dead, torch.zeros_like(weights), weights / torch.where(dead, 1.0, denom))

    if dropout_p > 0.0:
        if dropout_p >= 1.0:
            probs = torch.zeros_like(probs)
        else:
            keep = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=cdt) >= dropout_p
            probs = probs * keep / (1.0 - dropout_p)

    out = torch.matmul(probs, v)  # [B, Hq, Sq, Dv]
    if name == "BSHD":
        out = out.transpose(1, 2)
    return out.contiguous().to(out_dtype)
