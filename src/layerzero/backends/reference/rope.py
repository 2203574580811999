"""Reference rotary position embedding (RoPE, Su et al. 2021, "RoFormer"): the oracle for rope kernels.

Plain PyTorch, computed in float32 (float64 when q is float64), returned in the input dtypes.
"""

from __future__ import annotations

from typing import Any

import torch

from layerzero.core.errors import InvalidInputError, expected_got

__all__ = ["qk_norm_rope", "rope", "rotate_half", "rotate_every_two"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` on the last dim, where x1/x2 are its first/second halves (GPT-NeoX / HF Llama)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """Pairs ``(x0, x1), (x2, x3), ...`` of the last dim become ``(-x1, x0), (-x3, x2), ...`` (GPT-J)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _layout_name(layout: Any) -> str:
    name = str(getattr(layout, "value", layout)).upper()
    if name not in ("BHSD", "BSHD"):
        raise InvalidInputError(
            expected_got("reference.rope: layout", "one of ['BHSD', 'BSHD']", repr(layout),
                         "Use 'BHSD' for [B, H, S, D] tensors or 'BSHD' for [B, S, H, D].")
        )  # fmt: skip
    return name


def _gather(table: torch.Tensor, position_ids: torch.Tensor | None, seq_len: int, which: str) -> torch.Tensor:
    """cos or sin as ``[B or 1, S, R]``, gathered from a table or taken as given."""
    if table.dim() == 3:
        if position_ids is not None:
            raise InvalidInputError(
                expected_got(f"reference.rope: position_ids with an already gathered {which} [B, S, R]",
                             "position_ids=None", f"a tensor of shape {tuple(position_ids.shape)}",
                             f"Pass the [max_pos, R] table as {which} to index it, or drop position_ids.")
            )  # fmt: skip
        return table
    if position_ids is None:
        return table[:seq_len].unsqueeze(0)  # positions 0..S-1
    return table[position_ids]  # [B, S, R]


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    layout: str = "BHSD",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embeddings to q and k.

    Shapes (B batch, Hq/Hkv heads, S sequence, D head dim, R rotary dim, R <= D and even):

    - layout ``"BHSD"``: q ``[B, Hq, S, D]``, k ``[B, Hkv, S, D]``; ``"BSHD"``: q ``[B, S, Hq, D]``, k
      ``[B, S, Hkv, D]``.
    - cos/sin, one of: a table ``[max_pos, R]`` indexed by ``position_ids [B, S]`` (int64); the same table
      with ``position_ids=None`` (positions ``0..S-1``, so an ``[S, R]`` table works too); or already
      gathered ``[B, S, R]`` (then ``position_ids`` must be None).

    Dims ``>= R`` of each head pass through unchanged (partial rotary, GPT-NeoX ``rotary_pct``).

    - ``interleaved=False`` (GPT-NeoX / Llama half rotation): cos/sin have Hugging Face's layout
      ``cat(f, f)`` and ``x_rot = x * cos + rotate_half(x) * sin``; bit-for-bit equal to transformers'
      ``apply_rotary_pos_emb`` for float32 inputs.
    - ``interleaved=True`` (GPT-J / Meta Llama complex form): cos/sin are ``repeat_interleave(f, 2)`` and
      the pairs ``(x0, x1), (x2, x3), ...`` are rotated: ``x * cos + rotate_every_two(x) * sin``.

    Args:
        q, k: query and key tensors (any float dtype), in ``layout``.
        cos, sin: rotary tables as above (any float dtype; used in the compute dtype).
        position_ids: ``[B, S]`` int64 positions into the table, or None.
        interleaved: pair layout, see above.
        layout: ``"BHSD"`` or ``"BSHD"`` (a str-valued Enum member is accepted too).

    Returns:
        ``(q_out, k_out)`` with q's and k's shapes and dtypes; computed in float32 (float64 if q or
        k is float64).

    Raises:
        InvalidInputError: unknown ``layout``; ``position_ids`` given with already gathered ``[B, S, R]``
        cos/sin. Other checks (R even, R <= D, shapes) are the ops layer's job.

    >>> q = torch.tensor([[[[1.0, 0.0]]]]); c = torch.zeros(1, 2); s = torch.ones(1, 2)  # 90 degrees
    >>> rope(q, q, c, s)[0]
    tensor([[[[0., 1.]]]])
    """
    return _rotate(q, k, cos, sin, position_ids, interleaved, layout, None, None, 0.0)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    layout: str = "BHSD",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (``x * rsqrt(mean(x^2 over D) + eps) * weight``, Zhang & Sennrich 2019),
    then :func:`rope` of the normalized values, all in float32 (float64 when q or k is float64) with one
    rounding to the input dtypes. Shapes as :func:`rope`; ``q_weight`` / ``k_weight`` ``[D]``; ``eps``
    unitless. Raises as :func:`rope`."""
    return _rotate(q, k, cos, sin, position_ids, interleaved, layout, q_weight, k_weight, eps)


def _rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    layout: str,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope` of q and k, each RMS-normalized over its head dim with its weight first when one is given,
    rounded once to its dtype."""
    name = _layout_name(layout)
    cdt = torch.float64 if torch.float64 in (q.dtype, k.dtype) else torch.float32
    seq_len = q.shape[2] if name == "BHSD" else q.shape[1]
    c = _gather(cos, position_ids, seq_len, "cos").to(cdt)
    s = _gather(sin, position_ids, seq_len, "sin").to(cdt)
    head_axis = 1 if name == "BHSD" else 2  # broadcast [B, S, R] over the heads
    c, s = c.unsqueeze(head_axis), s.unsqueeze(head_axis)
    rot_dim = c.shape[-1]
    rotate = rotate_every_two if interleaved else rotate_half

    def apply(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        xf = x.to(cdt)
        if weight is not None:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(cdt)
        x_rot, x_pass = xf[..., :rot_dim], xf[..., rot_dim:]
        out = (x_rot * c) + (rotate(x_rot) * s)
        return torch.cat((out, x_pass), dim=-1).to(x.dtype)

    return apply(q, q_weight), apply(k, k_weight)
