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
its sequence owns: inside the verified chunk when a draft was rejected, else the slot after it, which is in
the same block unless the chunk ended a block. In that one case (every draft accepted and the chunk's last
position the end of a block) the slot is not allocated yet: that row writes nothing (slot -1) and its drafts
are not taken."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.sched.output import SchedulerOutput
from ..worker.attn_metadata import ForwardBatch
from ..worker.staging import to_device

__all__ = ["Ahead", "ahead_batch", "ahead_drafts"]


@dataclass
class Ahead:
    """A launched first draft step: the verified rows' sequences (``seq_ids``) and first positions
    (``starts``), their draft count ``k``, which rows' chunk ended a block (``ends_block``), the drafts
    ``tokens`` ``[R]`` int64 on the device, and, once the verification was read, each row's accepted count
    (``accepted``; None before)."""

    seq_ids: list[int]
    starts: list[int]
    k: int
    ends_block: list[bool]
    tokens: torch.Tensor
    accepted: list[int] | None = None

    def matches(self, out: SchedulerOutput, chunks: list[int]) -> bool:
        """Whether the speculating chunks ``chunks`` of ``out`` (the next round) are the rounds this step was
        launched for: the same sequences in the same order, each at its position after its accepted drafts,
        none of them the unallocated slot's case."""
        if self.accepted is None or [out.seq_ids[i] for i in chunks] != self.seq_ids:
            return False
        return all(
            out.num_computed_tokens[i] == s + 1 + a and not (a == self.k and e)
            for i, s, a, e in zip(chunks, self.starts, self.accepted, self.ends_block, strict=True)
        )


def ahead_drafts(out: SchedulerOutput) -> int:
    """The draft count k when the verification step ``out`` launches the next round's first draft step
    (every chunk verifies k drafts and samples greedily, no prompt logprobs, and no row can reach its
    ``max_tokens`` in this round: a row that ends leaves the next round another batch), else 0."""
    spec = out.spec_token_ids
    if not spec or not all(spec) or not all(out.sample) or out.prompt_logprobs:
        return 0
    k = len(spec[0])
    rows = out.sampling
    if any(len(d) != k for d in spec) or not all(p.greedy for p in rows.params):
        return 0
    if any(p.max_tokens - n <= k + 1 for p, n in zip(rows.params, rows.num_output_tokens, strict=True)):
        return 0
    return k


def ahead_batch(
    out: SchedulerOutput, k: int, tokens: torch.Tensor, accepted: torch.Tensor, block_size: int
) -> tuple[ForwardBatch, list[int], list[bool]]:
    """The next round's first draft step of the verification step ``out`` (every chunk verifying ``k``
    drafts, :func:`ahead_drafts`) as a decode :class:`ForwardBatch` on the device, from the verification's
    ``tokens`` ``[R, k + 1]`` int64 and ``accepted`` ``[R]`` int64 (device): row r's input is
    ``tokens[r, accepted[r]]`` at position ``start_r + 1 + accepted[r]``, its slot from its block table
    (where every draft was accepted and the chunk ended a block, that slot is not allocated: the row runs at
    the chunk's last position, writes nothing (slot -1), and its drafts are not taken). Returns the
    batch, the rows' first positions and which rows' chunk ended a block. One host-to-device copy, no
    synchronization."""
    dev = tokens.device
    starts = np.asarray(out.num_computed_tokens, dtype=np.int64)
    ends = (starts + k + 1) % block_size == 0
    start_t, ends_t, tables = to_device(
        [starts, ends.astype(np.int64), np.ascontiguousarray(out.block_tables)], dev
    )
    unallocated = (accepted == k) & (ends_t != 0)
    # such a row runs at the chunk's last position instead (inside its table) and writes nothing
    pos = start_t + 1 + accepted - unallocated.to(torch.int64)
    ids = tokens.gather(1, accepted[:, None]).squeeze(1)
    block = tables.gather(1, (pos // block_size)[:, None]).squeeze(1).to(torch.int64)
    slots = torch.where(unallocated, -1, block * block_size + pos % block_size)
    r = ids.shape[0]
    batch = ForwardBatch(
        ids,
        pos,
        slots,
        tables,
        (pos + 1).to(torch.int32),
        None,
        torch.arange(r, device=dev),
        r,
        logits_all=True,
    )
    return batch, starts.tolist(), ends.tolist()
