"""Rotary position embedding tables and their application through ``lz.rope``."""

from __future__ import annotations

from typing import Any

import torch

import layerzero as lz

from ..config import ModelConfig
from ..errors import bad_config

__all__ = ["RotaryEmbedding"]

UNSUPPORTED = ("dynamic", "longrope")
"""RoPE types whose frequencies change with the sequence length at run time (not a fixed table)."""


def inv_freq(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    """``(inv_freq [D/2] float32, attention scaling)`` of the config's RoPE: ``theta ** (-2i/D)`` for the
    default type (RoFormer, Su et al. 2021), else transformers' own init function for the type (``linear``,
    ``llama3``, ``yarn``, ...), so scaled RoPE matches transformers exactly.

    Raises:
        ConfigurationError: a RoPE type with run-time dependent frequencies (``dynamic``, ``longrope``).
    """
    rt = cfg.rope.rope_type
    if rt == "default":
        d = cfg.head_dim
        return 1.0 / (
            cfg.rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
        ), 1.0
    if rt in UNSUPPORTED:
        raise bad_config(
            "rope type",
            f"a fixed-table type (default, linear, llama3, yarn), not one of {UNSUPPORTED}",
            repr(rt),
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn: Any = ROPE_INIT_FUNCTIONS.get(rt)
    if fn is None:
        raise bad_config("rope type", f"one of {['default', *sorted(ROPE_INIT_FUNCTIONS)]}", repr(rt))
    freq, scale = fn(cfg.hf_config, device)
    return freq.float(), float(scale)


class RotaryEmbedding:
    """cos/sin tables ``[max_positions, D]`` (NeoX half rotation: ``cat(f, f)``, times the type's attention
    scaling) in the model dtype, as transformers' rotary embedding builds them; :meth:`__call__` rotates q/k
    by each token's position through :func:`layerzero.rope`."""

    def __init__(
        self, cfg: ModelConfig, max_positions: int, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        freq, scale = inv_freq(cfg, device)
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        emb = torch.cat([torch.outer(t, freq)] * 2, dim=-1)
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k ``[T, Hkv, D]``, positions ``[T]`` int64 -> rotated ``(q, k)``, same shapes."""
        t = q.shape[0]
        qr, kr = lz.rope(
            q.unsqueeze(0),
            k.unsqueeze(0),
            self.cos,
            self.sin,
            position_ids=positions.view(1, t),
            layout="BSHD",
        )
        return qr.squeeze(0), kr.squeeze(0)

    def with_qk_norm(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k (Qwen3's ``q_norm`` / ``k_norm``, weights ``[D]``), then RoPE, in one
        :func:`layerzero.qk_norm_rope` call; shapes as :meth:`__call__`."""
        t = q.shape[0]
        qr, kr = lz.qk_norm_rope(
            q.unsqueeze(0),
            k.unsqueeze(0),
            q_weight,
            k_weight,
            self.cos,
            self.sin,
            eps=eps,
            position_ids=positions.view(1, t),
            layout="BSHD",
        )
        return qr.squeeze(0), kr.squeeze(0)
