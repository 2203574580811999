"""``ForwardBatch``: the per-step attention metadata, built once per step and read by every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ForwardBatch", "ScheduledChunk", "build_forward_batch"]


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's share of a step: tokens ``token_ids[start:start + length]`` at positions
    ``start .. start + length - 1``, its block table (block ids, enough for ``start + length`` tokens), and
    whether the step samples its next token (the chunk reaches the end of its known tokens)."""

    token_ids: Sequence[int]
    start: int
    length: int
    block_table: Sequence[int]
    sample: bool


@dataclass
class ForwardBatch:
    """What one step's forward needs (T = new tokens of all sequences, B = sequences, M = block-table width):

    - ``input_ids`` ``[T]`` int64, ``positions`` ``[T]`` int64 (token positions in their sequence);
    - ``slot_mapping`` ``[T]`` int64: cache slot of each new token (``block * block_size + offset``; -1 = skip);
    - ``block_tables`` ``[B, M]`` int32 (rows padded with 0), ``seq_lens`` ``[B]`` int32 (KV length including the
      new tokens), ``cu_seqlens_q`` ``[B + 1]`` int32 prefix sums of the new tokens, or None when every sequence has
      one new token (a pure decode step);
    - ``logits_indices`` ``[S]`` int64: rows of the hidden states whose next token is sampled (each sampled
      sequence's last new token), in chunk order.

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

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (the CUDA-graph path)."""
        return self.cu_seqlens_q is None


def build_forward_batch(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device) -> ForwardBatch:
    """The :class:`ForwardBatch` of ``chunks`` (in order), built on the host with numpy and copied to ``device``
    in one transfer per tensor. A pure decode step (one token per chunk) takes a scalar path: no per-chunk numpy
    arrays, ~4x less host time at 256 sequences."""
    if all(c.length == 1 for c in chunks):
        return _decode_batch(chunks, block_size, device)
    lengths = np.fromiter((c.length for c in chunks), dtype=np.int64, count=len(chunks))
    cu = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    total = int(cu[-1])
    ids = np.empty(total, dtype=np.int64)
    pos = np.empty(total, dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    width = max(len(c.block_table) for c in chunks)
    tables = np.zeros((len(chunks), width), dtype=np.int32)
    seq_lens = np.empty(len(chunks), dtype=np.int32)
    sample = []
    for i, c in enumerate(chunks):
        a, b = int(cu[i]), int(cu[i + 1])
        p = np.arange(c.start, c.start + c.length, dtype=np.int64)
        table = np.asarray(c.block_table, dtype=np.int64)
        ids[a:b] = c.token_ids[c.start:c.start + c.length]
        pos[a:b] = p
        slots[a:b] = table[p // block_size] * block_size + p % block_size
        tables[i, :len(table)] = table
        seq_lens[i] = c.start + c.length
        if c.sample:
            sample.append(b - 1)

    return ForwardBatch(_dev(ids, device), _dev(pos, device), _dev(slots, device), _dev(tables, device),
                        _dev(seq_lens, device), _dev(cu.astype(np.int32), device),
                        _dev(np.asarray(sample, dtype=np.int64), device), len(chunks))


def _dev(x: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(x)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _decode_batch(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device) -> ForwardBatch:
    """:func:`build_forward_batch` of chunks of one token each (``cu_seqlens_q`` None)."""
    pos = [c.start for c in chunks]
    ids = [c.token_ids[p] for c, p in zip(chunks, pos, strict=True)]
    slots = [c.block_table[p // block_size] * block_size + p % block_size for c, p in zip(chunks, pos, strict=True)]
    width = max(len(c.block_table) for c in chunks)
    tables = np.zeros((len(chunks), width), dtype=np.int32)
    for i, c in enumerate(chunks):
        tables[i, :len(c.block_table)] = c.block_table
    sample = [i for i, c in enumerate(chunks) if c.sample]
    return ForwardBatch(_dev(np.asarray(ids, dtype=np.int64), device), _dev(np.asarray(pos, dtype=np.int64), device),
                        _dev(np.asarray(slots, dtype=np.int64), device), _dev(tables, device),
                        _dev(np.asarray(pos, dtype=np.int32) + 1, device), None,
                        _dev(np.asarray(sample, dtype=np.int64), device), len(chunks))
