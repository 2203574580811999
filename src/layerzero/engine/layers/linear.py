"""Linear layers with packed weights (one matmul for q/k/v and for gate/up, through ``lz.linear``) and the
vocabulary embedding."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import layerzero as lz

from ..errors import bad_config

__all__ = ["Embedding", "Linear"]


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``, W ``[out_features, in_features]``. ``shards`` names the row blocks of a packed
    weight in order (``(("q", Hq*D), ("k", Hkv*D), ("v", Hkv*D))`` for QKV): :meth:`load` copies a
    checkpoint's separate ``q_proj`` / ``k_proj`` / ``v_proj`` tensors into their rows, so the layer runs one
    matmul."""

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[tuple[str, int]],
        *,
        bias: bool = False,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        shards = [("", out_features)] if isinstance(out_features, int) else list(out_features)
        self.offsets: dict[str, tuple[int, int]] = {}
        at = 0
        for name, size in shards:
            self.offsets[name] = (at, size)
            at += size
        self.weight = nn.Parameter(
            torch.empty(at, in_features, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(at, device=device, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in_features]`` -> ``[T, out_features]`` through :func:`layerzero.linear` (cuBLAS by
        default; policies, locks and ``lz.tune`` apply)."""
        return lz.linear(x, self.weight, self.bias)

    def load(self, tensor: torch.Tensor, shard: str = "", *, bias: bool = False) -> None:
        """Copy a checkpoint tensor into shard ``shard``'s rows (the whole weight for an unpacked layer).

        Raises:
            ConfigurationError: unknown shard or a shape that does not fit (a checkpoint/config mismatch).
        """
        if shard not in self.offsets:
            raise bad_config("packed linear shard", f"one of {sorted(self.offsets)}", repr(shard))
        start, size = self.offsets[shard]
        dst = self.bias if bias else self.weight
        if dst is None:
            raise bad_config("linear bias", "a layer with bias (config attention_bias)", "a bias tensor")
        dst = dst[start : start + size]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise bad_config(
                f"checkpoint tensor for linear shard {shard or 'weight'}",
                list(dst.shape),
                list(tensor.shape),
                "The checkpoint does not match its config.json.",
            )
        dst.copy_(tensor)


class Embedding(nn.Module):
    """Token embedding ``[V, H]``: ids ``[T]`` int64 -> ``[T, H]``; also the LM head when embeddings are
    tied."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids ``[T]`` -> ``[T, H]``."""
        return F.embedding(ids, self.weight)
