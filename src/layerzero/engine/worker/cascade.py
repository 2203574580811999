"""Cascade attention for steps whose sequences share prefix blocks (Ye et al. 2024, "Cascade Inference";
FlashInfer's ``MultiLevelCascadeAttentionWrapper``, vLLM's cascade attention, SGLang's shared-prefix decode).

With prefix caching, requests that share a prompt prefix share its KV blocks (the same block ids). Plain paged
attention still reads those blocks once per request; at 16 requests over a 2048-token prefix that is 16x the
prefix's bytes every step, which bounds the whole step. A cascade step splits each query token's keys in two:

- the shared level: one paged-attention "sequence" per group of requests sharing their first k blocks, whose
  query tokens are the members' new tokens and whose KV is the k shared blocks, not causal (every member's new
  tokens come after the whole prefix): ``lz.paged_attention(..., is_causal=False, return_lse=True)`` reads the
  prefix once per group;
- the unique level: each request's own blocks after the shared ones (all of its blocks when it shares none: a
  group of one with an empty prefix), its new tokens causal over them:
  ``lz.paged_attention(..., return_lse=True)``;

then ``lz.merge_attention_states`` combines the two by their log-sum-exps, which is exactly attention over the
union (the merge is FlashDecoding's split merge). One level of sharing per group: the group's prefix is the
blocks all its members share, and never a block holding one of a member's new tokens.

Decode steps (one new token per sequence) run it inside their CUDA graphs (:mod:`.cuda_graph`). Steps with
prefill chunks run eagerly and plan it the same way: in a shared-prefix workload the steps that admit new
requests also carry ~250 decode rows, whose prefix reads otherwise dominate them (~50 ms against ~9 ms for a
cascade decode step on an H200, benchmarks/results/engine/h200/README.md); a new request that hit the cached
prefix joins its group.

:func:`plan_cascade` decides on the host from the step's block tables (numpy, no device work); a step that
saves too little runs as plain attention (a decode step keeps its plain CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .attn_metadata import CascadeBatch

__all__ = ["CascadeBatch", "CascadePolicy", "plan_cascade"]


@dataclass(frozen=True)
class CascadePolicy:
    """When a step (decode, or with prefill chunks) runs as cascade attention. ``min_saved_tokens``: the KV
    tokens per layer that the shared level saves reading (sum over groups of
    ``(members - 1) * prefix tokens``) must reach this, and ``min_saved_fraction`` of the step's KV tokens.
    ``always``: any group qualifies (tests, ``cascade_attention=True``).

    Defaults: a step whose prefix reads would save >= 16,384 tokens and half of its KV: on a Qwen3-0.6B shape
    (112 KiB of KV per token over 28 layers) that is >= 1.8 GB of reads per step, ~0.4 ms of an H200's
    bandwidth, more than the eager launches a cascade step costs instead of its decode graph."""

    min_saved_tokens: int = 16384
    min_saved_fraction: float = 0.5
    always: bool = False


def plan_cascade(
    tables: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    policy: CascadePolicy,
    q_lens: np.ndarray | None = None,
) -> tuple[list[np.ndarray], int] | None:
    """The host arrays of a cascade step ``[rows, prefix_tables, prefix_lens, cu_prefix, suffix_tables,
    suffix_lens]`` (plus ``cu_seqlens_q`` when ``q_lens`` is given; dtypes as :class:`CascadeBatch`) and the
    saved tokens, or None when the step should run as plain attention.

    ``tables`` ``[B, M]`` int32 block tables, ``seq_lens`` ``[B]`` int32 KV lengths including the new tokens,
    ``q_lens`` ``[B]`` new tokens per sequence (None: one each, a decode step). Sequences are grouped by equal
    leading block ids (sorted by their first block); a group's prefix is the blocks every member shares,
    capped so that no member's new token is in it (each member keeps the block of its first new token for the
    unique level). Sequences in no group of two or more are groups of one with an empty prefix."""
    b = tables.shape[0]
    if b < 2:
        return None
    q = np.ones(b, dtype=np.int64) if q_lens is None else q_lens.astype(np.int64)
    usable = (
        seq_lens.astype(np.int64) - q
    ) // block_size  # whole blocks before the one holding the first new token
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
    if (
        saved == 0
        or not policy.always
        and (saved < policy.min_saved_tokens or saved < policy.min_saved_fraction * float(seq_lens.sum()))
    ):
        return None
    kmax = max(1, max(k for _, _, k in groups))
    prefix_tables = np.zeros((len(groups), kmax), dtype=np.int32)
    prefix_lens = np.empty(len(groups), dtype=np.int32)
    cu_seqs = np.zeros(len(groups) + 1, dtype=np.int64)  # group boundaries in the sorted sequence order
    suffix_tables = np.zeros_like(tables)
    suffix_lens = seq_lens.astype(np.int32)[order]
    width = tables.shape[1]
    for g, (first, end, k) in enumerate(groups):
        members = order[first:end]
        prefix_tables[g, :k] = tables[members[0], :k]
        prefix_lens[g] = k * block_size
        cu_seqs[g + 1] = end
        suffix_tables[first:end, : width - k] = tables[members, k:]
        suffix_lens[first:end] -= k * block_size
    if q_lens is None:  # a decode step: token rows are sequence rows
        return [
            order.astype(np.int64),
            prefix_tables,
            prefix_lens,
            cu_seqs.astype(np.int32),
            suffix_tables,
            suffix_lens,
        ], saved
    starts = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(q, out=starts[1:])
    q_sorted = q[order]
    cu_q = np.zeros(b + 1, dtype=np.int64)  # the sorted sequences' token offsets in the cascade's order
    np.cumsum(q_sorted, out=cu_q[1:])
    rows = np.repeat(starts[order] - cu_q[:-1], q_sorted) + np.arange(int(cu_q[-1]), dtype=np.int64)
    return [
        rows,
        prefix_tables,
        prefix_lens,
        cu_q[cu_seqs].astype(np.int32),
        suffix_tables,
        suffix_lens,
        cu_q.astype(np.int32),
    ], saved
