"""The per-step attention metadata, in one module that the attention layers
(:mod:`layerzero.engine.layers.attention`) and the worker (input batch, CUDA graphs, cascade planning) both
import: :class:`ForwardBatch` (built once per step, read by every layer; graph capture / replay update it in
place) and :class:`CascadeBatch` (a cascade step's two levels). Plain dataclasses of tensors: this module
imports nothing else of the engine, so the layers never import the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CascadeBatch", "ForwardBatch"]


@dataclass(frozen=True)
class CascadeBatch:
    """A cascade step's metadata on the device (B sequences and T new tokens in the step, G groups; every
    sequence is in one group, a sequence that shares nothing is a group of one with an empty prefix):

    - ``rows`` ``[T]`` int64: a permutation of the step's token rows, group after group and each sequence's
      tokens in order (the cascade's order; a decode step's T = B rows are its sequences);
    - ``prefix_tables`` ``[G, K]`` int32, ``prefix_lens`` ``[G]`` int32 (tokens, a multiple of the block size;
      0 for a group of one), ``cu_prefix`` ``[G + 1]`` int32 (prefix sums of the groups' token counts): the
      shared level's arguments (``is_causal=False``: an empty prefix gives its rows 0 and lse -inf, which the
      merge ignores);
    - ``suffix_tables`` ``[B, M]`` int32, ``suffix_lens`` ``[B]`` int32, in the cascade's sequence order: each
      sequence's blocks after its group's prefix and their token count, the unique level's arguments;
    - ``saved_tokens``: KV tokens per layer the shared level does not read again (for the metrics);
    - ``cu_seqlens_q`` ``[B + 1]`` int32: prefix sums of the sequences' new tokens in the cascade's order (the
      unique level's, causal); None in a decode step (one token each).

    The attention layer gathers q into the cascade's order once, runs both levels and the merge there, and
    scatters the result back (:func:`layerzero.engine.layers.attention.cascade_attention`). In a decode step
    all shapes but G and K are the step's, so a decode CUDA graph can hold it padded to its bucket
    (:mod:`.cuda_graph`)."""

    rows: torch.Tensor
    prefix_tables: torch.Tensor
    prefix_lens: torch.Tensor
    cu_prefix: torch.Tensor
    suffix_tables: torch.Tensor
    suffix_lens: torch.Tensor
    saved_tokens: int
    cu_seqlens_q: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    """What one step's forward needs (T = new tokens of all sequences, B = sequences, M = block-table width):

    - ``input_ids`` ``[T]`` int64, ``positions`` ``[T]`` int64 (token positions in their sequence);
    - ``slot_mapping`` ``[T]`` int64: cache slot of each new token (``block * block_size + offset``; -1 =
      skip);
    - ``block_tables`` ``[B, M]`` int32 (rows padded with 0), ``seq_lens`` ``[B]`` int32 (KV length including
      the new tokens), ``cu_seqlens_q`` ``[B + 1]`` int32 prefix sums of the new tokens, or None when every
      sequence has one new token (a pure decode step);
    - ``logits_indices`` ``[S]`` int64: rows of the hidden states whose next token is sampled (each sampled
      sequence's last new token), in chunk order.

    - ``cascade``: the step's cascade-attention metadata when its sequences share enough prefix blocks
      (:mod:`.cascade`), else None.
    - ``graphed``: built by the CUDA-graph runner (:mod:`.cuda_graph`): this forward is a capture or its
      warm-up, so its host work is paid once and replays run only its kernels; a model may then take calls
      that cost more host time for fewer kernels (``lz.rope_paged_attention``).
    - ``packed``: the tensors are the first ``num_seqs`` rows of a decode graph bucket's packed input buffer
      of lane ``lane`` (:func:`build_packed_decode_batch`): that lane's graphs read them where they are,
      nothing is copied in.
    - ``logits_all``: every row of the hidden states is sampled, in order (``logits_indices`` is
      ``arange(T)``: a decode step whose sequences all sample, a graph bucket): the model skips the gather.
    - ``pieces``: set while piecewise CUDA graphs (:mod:`.piecewise`) warm up or capture this forward: each
      attention call goes through ``pieces.attend`` (it ends one captured piece, runs the attention eagerly on
      the step's own metadata, starts the next piece); None otherwise.

    Every layer passes the same tensors to :func:`layerzero.paged_attention` (FlashInfer plans once per step).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    logits_indices: torch.Tensor
    num_seqs: int
    cascade: CascadeBatch | None = None
    graphed: bool = False
    packed: bool = False
    logits_all: bool = False
    lane: int = 0
    pieces: Any = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (the CUDA-graph path)."""
        return self.cu_seqlens_q is None
