"""Cascade attention for decode steps whose sequences share prefix blocks (Ye et al. 2024, "Cascade Inference";
FlashInfer's ``MultiLevelCascadeAttentionWrapper``, vLLM's cascade attention, SGLang's shared-prefix decode).

With prefix caching, requests that share a prompt prefix share its KV blocks (the same block ids). Plain paged
decode still reads those blocks once per request; at 16 requests over a 2048-token prefix that is 16x the prefix's
bytes every step, which bounds the whole step. A cascade step splits each decode query's keys in two:

- the shared level: one paged-attention "sequence" per group of requests sharing their first k blocks, whose query
  tokens are the members' decode queries and whose KV is the k shared blocks, not causal (every member sees the
  whole prefix): ``lz.paged_attention(..., is_causal=False, return_lse=True)`` reads the prefix once per group;
- the unique level: each request's own blocks after the shared ones (all of its blocks when it shares none: a group
  of one with an empty prefix), one decode query each: ``lz.paged_attention(..., return_lse=True)``;

then ``lz.merge_attention_states`` combines the two by their log-sum-exps, which is exactly attention over the
union (the merge is FlashDecoding's split merge). One level of sharing per group: the group's prefix is the blocks
all its members share.

:func:`plan_cascade` decides on the host from the step's block tables (numpy, no device work); a step that saves
too little runs as plain decode (and keeps its CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CascadeBatch", "CascadePolicy", "plan_cascade"]


@dataclass(frozen=True)
class CascadePolicy:
    """When a decode step runs as cascade attention. ``min_saved_tokens``: the KV tokens per layer that the shared
    level saves reading (sum over groups of ``(members - 1) * prefix tokens``) must reach this, and
    ``min_saved_fraction`` of the step's KV tokens. ``always``: any group qualifies (tests, ``cascade_attention=True``).

    Defaults: a step whose prefix reads would save >= 16,384 tokens and half of its KV: on a Qwen3-0.6B shape
    (112 KiB of KV per token over 28 layers) that is >= 1.8 GB of reads per step, ~0.4 ms of an H200's bandwidth, more
    than the eager launches a cascade step costs instead of its decode graph."""

    min_saved_tokens: int = 16384
    min_saved_fraction: float = 0.5
    always: bool = False


@dataclass(frozen=True)
class CascadeBatch:
    """A cascade step's metadata on the device (B rows in the step, G groups; every row is in one group, a row that
    shares nothing is a group of one with an empty prefix):

    - ``rows`` ``[B]`` int64: a permutation of the batch rows, group after group (the cascade's row order);
    - ``prefix_tables`` ``[G, K]`` int32, ``prefix_lens`` ``[G]`` int32 (tokens, a multiple of the block size; 0 for
      a group of one), ``cu_prefix`` ``[G + 1]`` int32 (prefix sums of the group sizes): the shared level's
      arguments (``is_causal=False``: an empty prefix gives its row 0 and lse -inf, which the merge ignores);
    - ``suffix_tables`` ``[B, M]`` int32, ``suffix_lens`` ``[B]`` int32, in the cascade's row order: each row's
      blocks after its group's prefix and their token count, the unique level's decode arguments;
    - ``saved_tokens``: KV tokens per layer the shared level does not read again (for the metrics).

    The attention layer gathers q into the cascade's order once, runs both levels and the merge there, and scatters
    the result back (:func:`layerzero.engine.layers.attention.cascade_attention`). All shapes but G and K are the
    step's, so a decode CUDA graph can hold a cascade step padded to its bucket (:mod:`.cuda_graph`)."""

    rows: torch.Tensor
    prefix_tables: torch.Tensor
    prefix_lens: torch.Tensor
    cu_prefix: torch.Tensor
    suffix_tables: torch.Tensor
    suffix_lens: torch.Tensor
    saved_tokens: int


def plan_cascade(tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
                 policy: CascadePolicy) -> tuple[list[np.ndarray], int] | None:
    """The host arrays of a cascade step ``[rows, prefix_tables, prefix_lens, cu_prefix, suffix_tables,
    suffix_lens]`` (dtypes as :class:`CascadeBatch`) and the saved tokens, or None when the step should run as plain
    decode.

    ``tables`` ``[B, M]`` int32 block tables, ``seq_lens`` ``[B]`` int32 KV lengths including the new token. Rows are
    grouped by equal leading block ids (sorted by their first block); a group's prefix is the blocks every member
    shares, capped so each member keeps its last token's block for the unique level. Rows in no group of two or
    more are groups of one with an empty prefix."""
    b = tables.shape[0]
    if b < 2:
        return None
    usable = (seq_lens.astype(np.int64) - 1) // block_size  # whole blocks before the one holding the new token
    order = np.argsort(tables[:, 0], kind="stable")
    t = tables[order]
    same = np.cumprod(t[1:] == t[:-1], axis=1).sum(axis=1)  # leading equal ids of adjacent rows
    pair = np.minimum(same, np.minimum(usable[order][1:], usable[order][:-1]))
    groups: list[tuple[int, int, int]] = []  # (first, end) in sorted order, shared blocks (0: a group of one)
    i = 0
    while i < b:
        j, k = i, int(pair[i]) if i < b - 1 else 0
        while j < b - 1 and pair[j] > 0:
            k = min(k, int(pair[j]))
            j += 1
        groups.append((i, j + 1, k))
        i = j + 1
    saved = sum((end - first - 1) * k * block_size for first, end, k in groups)
    if saved == 0 or not policy.always and (saved < policy.min_saved_tokens
                                            or saved < policy.min_saved_fraction * float(seq_lens.sum())):
        return None
    rows = order.astype(np.int64)  # groups are runs of the sorted order
    kmax = max(1, max(k for _, _, k in groups))
    prefix_tables = np.zeros((len(groups), kmax), dtype=np.int32)
    prefix_lens = np.empty(len(groups), dtype=np.int32)
    cu = np.zeros(len(groups) + 1, dtype=np.int32)
    suffix_tables = np.zeros_like(tables)
    suffix_lens = seq_lens.astype(np.int32)[order]
    width = tables.shape[1]
    for g, (first, end, k) in enumerate(groups):
        members = order[first:end]
        prefix_tables[g, :k] = tables[members[0], :k]
        prefix_lens[g] = k * block_size
        cu[g + 1] = end
        suffix_tables[first:end, :width - k] = tables[members, k:]
        suffix_lens[first:end] -= k * block_size
    return [rows, prefix_tables, prefix_lens, cu, suffix_tables, suffix_lens], saved
