"""Tensor-parallel linear layers and the vocabulary-parallel embedding / LM head (Megatron-LM's split, vLLM's
and nano-vllm's names). Each is a :class:`~..layers.linear.Linear` / :class:`~..layers.linear.Embedding`
holding this rank's shard, so the model runs it through the same ``lz.linear`` / ``lz.rms_norm_linear`` /
``lz.swiglu_linear`` calls as a one-rank model; the collectives go through :mod:`.comm`.

Every layer's ``load(tensor, shard)`` takes the FULL checkpoint tensor (a ``torch.Tensor`` or anything that
slices like one and has ``.shape``: the loader's lazy safetensors slice) and keeps only this rank's part, so a
rank reads only its shard from disk.

* :class:`ColumnParallelLinear`: output rows split (``W [out/tp, in]``); no collective (the output stays
  split). :class:`MergedColumnParallelLinear`: a packed gate/up weight, each shard's rows split.
  :class:`QKVParallelLinear`: query heads split; KV heads split, or replicated when ``tp > num_kv_heads``
  (each rank keeps the one KV head its query heads read).
* :class:`RowParallelLinear`: input columns split (``W [out, in/tp]``), the partial outputs all-reduced; the
  bias (replicated) is added by rank 0 only, before the reduction.
* :class:`VocabParallelEmbedding`: vocabulary rows split (the vocabulary padded to a multiple of ``tp``; the
  padding rows are zero), ids of other ranks masked to zero rows, then all-reduced. As the LM head
  (:class:`ParallelLMHead`, or the tied embedding) it computes its vocabulary slice of the logits and
  all-gathers them, so every rank holds the full ``[N, V]`` logits and samples identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import layerzero as lz

from ..errors import bad_config
from ..layers.linear import Embedding, Linear
from . import comm
from .state import ParallelState

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "divide",
    "kv_head_range",
    "materialize",
    "mark_sharded",
]


def divide(size: int, state: ParallelState, what: str) -> int:
    """``size // tp_size``.

    Raises:
        ConfigurationError: ``size`` not divisible by ``tp_size`` (names ``what``).
    """
    if size % state.tp_size:
        raise bad_config(
            f"{what} with tensor_parallel_size {state.tp_size}",
            f"a multiple of {state.tp_size}",
            size,
            "Pick a tensor_parallel_size that divides it.",
        )
    return size // state.tp_size


def kv_head_range(num_heads: int, num_kv_heads: int, state: ParallelState) -> tuple[int, int]:
    """(first KV head, KV heads) this rank holds: ``num_kv_heads / tp`` consecutive heads when ``tp`` divides
    ``num_kv_heads``, else (``tp`` a multiple of ``num_kv_heads``: replication) the one head its query heads
    ``[rank * Hq/tp, (rank + 1) * Hq/tp)`` read, ``rank * Hkv // tp``.

    Raises:
        ConfigurationError: ``num_heads`` not divisible by ``tp``; neither of ``num_kv_heads`` and ``tp`` a
            multiple of the other.
    """
    divide(num_heads, state, "num_attention_heads")
    tp, r = state.tp_size, state.tp_rank
    if num_kv_heads % tp == 0:
        n = num_kv_heads // tp
        return r * n, n
    if tp % num_kv_heads:
        raise bad_config(
            f"num_key_value_heads with tensor_parallel_size {tp}",
            f"a multiple of {tp} or a divisor of it (KV heads split or replicated)",
            num_kv_heads,
            "Pick a tensor_parallel_size that divides num_key_value_heads or is a multiple of it.",
        )
    return r * num_kv_heads // tp, 1


def materialize(tensor: Any) -> torch.Tensor:
    """``tensor`` as a ``torch.Tensor`` (a lazy slice is read whole)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


def mark_sharded(*params: torch.Tensor | None) -> None:
    """Tag parameters that hold a rank's shard (``param.tp_shard = True``): the dummy loader seeds them per
    rank; untagged parameters are replicated and must be equal on every rank."""
    for p in params:
        if p is not None:
            p.tp_shard = True  # type: ignore[attr-defined]


def _check_full(tensor: Any, dim: int, full: int, what: str) -> None:
    shape = tuple(tensor.shape)
    if len(shape) <= dim or shape[dim] != full:
        raise bad_config(
            f"checkpoint tensor for {what} (dim {dim}, before the tensor-parallel split)",
            full,
            list(shape),
            "The checkpoint does not match its config.json.",
        )


class ColumnParallelLinear(Linear):
    """``y_r = x @ W_r.T (+ b_r)``: this rank's rows of each shard of ``out_features`` (an int or packed
    ``(name, size)`` shards, as :class:`Linear`), every shard split evenly; the output ``[T, out/tp]`` stays
    split (the next layer is row-parallel or per-head). ``ranges`` (name -> (full size, first row, rows))
    overrides the even split (:class:`QKVParallelLinear`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[tuple[str, int]],
        *,
        bias: bool = False,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState,
        ranges: dict[str, tuple[int, int, int]] | None = None,
    ) -> None:
        shards = [("", out_features)] if isinstance(out_features, int) else list(out_features)
        if ranges is None:
            ranges = {}
            for name, size in shards:
                n = divide(size, parallel, f"output size of linear shard {name or 'weight'}")
                ranges[name] = (size, parallel.tp_rank * n, n)
        super().__init__(
            in_features,
            [(name, ranges[name][2]) for name, _ in shards],
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.parallel, self.ranges = parallel, ranges
        mark_sharded(self.weight, self.bias)

    def load(self, tensor: Any, shard: str = "", *, bias: bool = False) -> None:
        """Copy this rank's rows of the FULL checkpoint tensor of shard ``shard`` (see :meth:`Linear.load`).

        Raises:
            ConfigurationError: unknown shard; a full tensor of the wrong size.
        """
        if shard not in self.ranges:
            super().load(tensor, shard, bias=bias)  # raises: unknown shard
        full, start, n = self.ranges[shard]
        _check_full(tensor, 0, full, f"linear shard {shard or 'weight'}")
        super().load(materialize(tensor[start : start + n]), shard, bias=bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """A packed column-parallel weight (an MLP's gate/up: ``(("gate", I), ("up", I))``): each shard's rows
    split, so rank r holds ``[gate_r; up_r]`` and the SwiGLU of its output is its slice of the
    intermediate activation."""


class QKVParallelLinear(ColumnParallelLinear):
    """Packed QKV of this rank's heads: query heads ``[r * Hq/tp, (r+1) * Hq/tp)``, KV heads per
    :func:`kv_head_range` (split, or one replicated head when ``tp > Hkv``). ``num_heads`` /
    ``num_kv_heads``: this rank's counts."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = False,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState,
    ) -> None:
        d = head_dim
        hq = divide(num_heads, parallel, "num_attention_heads")
        kv0, hkv = kv_head_range(num_heads, num_kv_heads, parallel)
        ranges = {
            "q": (num_heads * d, parallel.tp_rank * hq * d, hq * d),
            "k": (num_kv_heads * d, kv0 * d, hkv * d),
            "v": (num_kv_heads * d, kv0 * d, hkv * d),
        }
        super().__init__(
            hidden,
            (("q", hq * d), ("k", hkv * d), ("v", hkv * d)),
            bias=bias,
            device=device,
            dtype=dtype,
            parallel=parallel,
            ranges=ranges,
        )
        self.num_heads, self.num_kv_heads = hq, hkv


class RowParallelLinear(Linear):
    """``y = sum_r x_r @ W_r.T (+ b)``: this rank's columns ``W_r [out, in/tp]`` of the weight applied to its
    slice ``x_r [T, in/tp]`` of the input, the partial outputs all-reduced; the (replicated) bias added by
    rank 0 only, before the reduction (:attr:`local_bias`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState,
    ) -> None:
        n = divide(in_features, parallel, "input size of a row-parallel linear")
        super().__init__(n, out_features, bias=bias, device=device, dtype=dtype)
        self.parallel, self.full_in, self.start = parallel, in_features, parallel.tp_rank * n
        mark_sharded(self.weight)

    @property
    def local_bias(self) -> torch.Tensor | None:
        """The bias this rank adds before the all-reduce (rank 0's; None elsewhere)."""
        return self.bias if self.parallel.tp_rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in/tp]`` (this rank's slice) -> ``[T, out]``, summed over the ranks."""
        return self.reduce(lz.linear(x, self.weight, self.local_bias))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The all-reduce of this rank's partial output ``y`` ``[T, out]`` (for callers that ran the local
        projection fused, e.g. ``lz.swiglu_linear``)."""
        return comm.all_reduce(y, self.parallel)

    def load(self, tensor: Any, shard: str = "", *, bias: bool = False) -> None:
        """Copy this rank's columns of the FULL checkpoint weight (the bias whole).

        Raises:
            ConfigurationError: see :meth:`Linear.load`; a full weight of the wrong size.
        """
        if bias:
            super().load(materialize(tensor), shard, bias=True)
            return
        _check_full(tensor, 1, self.full_in, "row-parallel linear weight")
        super().load(materialize(tensor[:, self.start : self.start + self.weight.shape[1]]), shard)


class VocabParallelEmbedding(Embedding):
    """This rank's rows ``[r * Vp/tp, (r+1) * Vp/tp)`` of the embedding, ``Vp`` the vocabulary padded up to a
    multiple of ``tp`` (the padding rows zero). forward: ids ``[T]`` -> ``[T, H]`` (other ranks' ids read
    zero rows, then all-reduced); :meth:`logits` when it is the LM head."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        parallel: ParallelState,
    ) -> None:
        per = -(-vocab_size // parallel.tp_size)
        super().__init__(per, hidden_size, device=device, dtype=dtype)
        self.parallel, self.vocab_size, self.hidden_size = parallel, vocab_size, hidden_size
        self.start = parallel.tp_rank * per
        self.rows = max(0, min(vocab_size - self.start, per))
        """Rows of this rank that are real tokens (the rest is padding)."""
        mark_sharded(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids ``[T]`` int64 -> ``[T, H]`` (the full embedding rows, after the all-reduce)."""
        local = ids - self.start
        mask = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(mask, local, 0), self.weight)
        out = out.masked_fill_(~mask.unsqueeze(-1), 0)
        return comm.all_reduce(out, self.parallel)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head: h ``[N, H]`` -> logits ``[N, V]`` (model dtype) on every rank: this rank's
        vocabulary slice through ``lz.linear``, all-gathered, the padding columns dropped."""
        out = comm.all_gather(lz.linear(h, self.weight), -1, self.parallel)
        return out if out.shape[-1] == self.vocab_size else out[:, : self.vocab_size].contiguous()

    @torch.no_grad()
    def load(self, tensor: Any, shard: str = "", *, bias: bool = False) -> None:
        """Copy this rank's rows of the FULL ``[V, H]`` checkpoint tensor; zero the padding rows.

        Raises:
            ConfigurationError: a tensor that is not ``[V, H]``.
        """
        if bias or shard or tuple(tensor.shape) != (self.vocab_size, self.hidden_size):
            raise bad_config(
                "checkpoint tensor for a vocabulary-parallel embedding / LM head",
                [self.vocab_size, self.hidden_size],
                f"{list(tensor.shape)}{' (a bias)' if bias else ''}",
                "The checkpoint does not match its config.json.",
            )
        if self.rows:
            self.weight[: self.rows].copy_(materialize(tensor[self.start : self.start + self.rows]))
        self.weight[self.rows :].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head ``[V, H]``, vocabulary-parallel (:meth:`VocabParallelEmbedding.logits`)."""
