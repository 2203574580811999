"""The next round's first draft step, launched before the verification is read ("draft ahead").

A speculative round is synchronous at one point: the host reads how many drafts each row accepted, appends
the tokens, schedules the next round and builds its first draft step, and the device idles meanwhile (about
0.4-0.7 ms a round for a Qwen3-8B-shaped layer-skip round at batch 1 on the H200, ~1.35 ms of idle a round
in all: ``benchmarks/results/decoding/spec_timeline_h200_2026-11-30/``). That first draft step needs only
what the device already holds: row r's next input is the verification's own token at its accepted count
(``tokens[r, accepted[r]]``, the target's bonus token), at position ``start + 1 + accepted[r]``. So the
verification queues it right behind its result, before the host waits (:func:`ahead_batch`), and the next
round's :meth:`~.proposer.DraftProposer.propose` takes its drafts instead of running the step again when the
round it schedules is the one assumed (:meth:`Ahead.matches`): the same sequences in the same order, each
starting where its accepted count put it. Otherwise the drafts are dropped and the step runs as before, so
the tokens never depend on it (the draft step is the same computation either way; only greedy rounds, whose
drafts draw no random numbers, launch it).

The step writes the draft's KV (the target's own for layer skip) at the next round's first position, a slot
its sequence owns: inside the verified chunk when a draft was rejected, else the slot after it. That slot is
in the chunk's last block unless the chunk ended a block; then it is not allocated before the next round, so
a step with such a row does not launch ahead, nor one whose row may reach ``max_tokens`` (a round without
the rows assumed drops the drafts: a draft step's work for nothing).

It pays where a round is short against the host's work between rounds: measured on the H200 (Qwen3-8B shape,
constructed weights, k = 4; ``benchmarks/results/decoding/README.md``), against the same engine without it,
1.05-1.07x at batch 1 (layer skip 2.03x / 2.02x of plain decoding, the 0.6B draft 1.85x), 0.99-1.01x at
batch 8 and 0.93-0.98x at batch 32 (not explained yet: each launched step was taken). So only a step of at
most ``DraftProposer.ahead_max_rows`` rows (:data:`AHEAD_MAX_ROWS` unless set) launches it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.sched.output import SchedulerOutput
from ..worker.attn_metadata import ForwardBatch
from ..worker.staging import to_device

__all__ = ["AHEAD_MAX_ROWS", "Ahead", "ahead_batch", "ahead_drafts"]

AHEAD_MAX_ROWS = 4
"""The default of ``DraftProposer.ahead_max_rows``: verification steps of more speculating rows do not launch
the next round's first draft step (measured: it helps at batch 1, is even at 8 and loses at 32)."""


@dataclass
class Ahead:
    """A launched first draft step: the verified rows' sequences (``seq_ids``) and first positions
    (``starts``), the drafts ``tokens`` ``[R]`` int64 on the device, and, once the verification was read,
    each row's accepted count (``accepted``; None before)."""

    seq_ids: list[int]
    starts: list[int]
    tokens: torch.Tensor
    accepted: list[int] | None = None

    def matches(self, out: SchedulerOutput, chunks: list[int]) -> bool:
        """Whether the speculating chunks ``chunks`` of ``out`` (the next round) are the rounds this step was
        launched for: the same sequences in the same order, each at its position after its accepted
        drafts."""
        if self.accepted is None or [out.seq_ids[i] for i in chunks] != self.seq_ids:
            return False
        return all(
            out.num_computed_tokens[i] == s + 1 + a
            for i, s, a in zip(chunks, self.starts, self.accepted, strict=True)
        )


def ahead_drafts(out: SchedulerOutput, block_size: int, max_rows: int = AHEAD_MAX_ROWS) -> int:
    """The draft count k when the verification step ``out`` launches the next round's first draft step
    (at most ``max_rows`` chunks, every one verifying k drafts and sampling greedily, no prompt
    logprobs, no row that can reach its ``max_tokens`` in this round, and no chunk that ends a block: the next
    round's first slot is then allocated whatever is accepted), else 0."""
    spec = out.spec_token_ids
    if not spec or len(spec) > max_rows or not all(spec) or not all(out.sample) or out.prompt_logprobs:
        return 0
    k = len(spec[0])
    rows = out.sampling
    if any(len(d) != k for d in spec) or not all(p.greedy for p in rows.params):
        return 0
    if any(p.max_tokens - n <= k + 1 for p, n in zip(rows.params, rows.num_output_tokens, strict=True)):
        return 0
    if any((s + k + 1) % block_size == 0 for s in out.num_computed_tokens):
        return 0
    return k


def ahead_batch(
    out: SchedulerOutput, tokens: torch.Tensor, accepted: torch.Tensor, block_size: int
) -> ForwardBatch:
    """The next round's first draft step of the verification step ``out`` (:func:`ahead_drafts` said yes) as
    a decode :class:`ForwardBatch` on the device, from the verification's ``tokens`` ``[R, k + 1]`` int64
    and ``accepted`` ``[R]`` int64 (device): row r's input is ``tokens[r, accepted[r]]`` at position
    ``start_r + 1 + accepted[r]``, its slot from its block table. One host-to-device copy, no
    synchronization."""
    dev = tokens.device
    start_t, tables = to_device(
        [np.asarray(out.num_computed_tokens, dtype=np.int64), np.ascontiguousarray(out.block_tables)], dev
    )
    pos = start_t + 1 + accepted
    ids = tokens.gather(1, accepted[:, None]).squeeze(1)
    block = tables.gather(1, (pos // block_size)[:, None]).squeeze(1).to(torch.int64)
    r = ids.shape[0]
    return ForwardBatch(
        ids,
        pos,
        block * block_size + pos % block_size,
        tables,
        (pos + 1).to(torch.int32),
        None,
        torch.arange(r, device=dev),
        r,
        logits_all=True,
    )
