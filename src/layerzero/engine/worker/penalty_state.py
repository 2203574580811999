"""Penalty state on the device: per penalized sequence, a row of output-token counts and a prompt-token
mask, kept on the worker's device across steps and updated there from each step's sampled tokens (vLLM v1
keeps its output-token state on the host; here nothing of it crosses to the host, so async scheduling keeps
penalized sequences: the pending token is counted on the device before the next step samples).

Life of a row: the engine core's :class:`~layerzero.engine.core.sched.output.SamplingMetadata` marks a
penalized row ``penalty_reset`` (with its prompt and known output token ids) on its first sampled step and
after every preemption; :meth:`PenaltyState.rows` then (re)builds the row; later steps send only the
sequence id. :meth:`PenaltyState.count` adds each step's drawn tokens right after the draw (device ops, no
synchronization). A preempted sequence (``SchedulerOutput.preempted_seq_ids``) or a finished one
(``SamplingMetadata.free_seq_ids``) gives its row back.

Memory: rows are allocated lazily, in a pool that doubles when full (first 8 rows), never ``[max_num_seqs,
V]`` up front: an engine whose requests use no penalties holds nothing. One row costs ``5 V`` bytes (int32
counts and a bool mask: 0.75 MiB for a 151,936-token vocabulary).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.sched.output import SamplingMetadata
from .staging import to_device

__all__ = ["PenaltyState"]

_FIRST_ROWS = 8


class PenaltyState:
    """The penalized sequences' counts ``[R, V]`` int32 and prompt masks ``[R, V]`` bool on ``device`` (R
    rows, grown on demand), and which row each sequence id holds."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.row_of: dict[int, int] = {}
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        """Rows allocated (held or free)."""
        return self.counts.shape[0]

    def release(self, seq_ids: list[int]) -> None:
        """Give back the rows of ``seq_ids`` (finished or preempted sequences; ids without a row are
        ignored)."""
        for sid in seq_ids:
            r = self.row_of.pop(sid, None)
            if r is not None:
                self._free.append(r)

    def _grow(self, need: int) -> None:
        """At least ``need`` free rows: the pool doubles (old rows copied) until it has them."""
        if len(self._free) >= need:
            return
        old = self.capacity
        new = max(_FIRST_ROWS, old)
        while new - old + len(self._free) < need:
            new *= 2
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old].copy_(self.counts)
        prompt[:old].copy_(self.prompt)
        self.counts, self.prompt = counts, prompt
        self._free.extend(range(new - 1, old - 1, -1))  # popped from the end: lowest row first

    def rows(self, sm: SamplingMetadata, penalized: list[int]) -> torch.Tensor:
        """The state rows ``[P]`` int64 (on the device) of the step's ``penalized`` rows (indices into
        ``sm``), (re)building those marked ``penalty_reset`` from their prompt and output token ids.

        Raises:
            RuntimeError: a penalized row neither marked for reset nor holding state (the engine core and the
                worker are out of step: a defect, never a user error).
        """
        reset = [i for i in penalized if sm.penalty_reset[i]]
        self._grow(sum(1 for i in reset if sm.seq_ids[i] not in self.row_of))
        for i in reset:
            sid = sm.seq_ids[i]
            if sid not in self.row_of:
                self.row_of[sid] = self._free.pop()
        idx = []
        for i in penalized:
            r = self.row_of.get(sm.seq_ids[i])
            if r is None:
                raise RuntimeError(
                    f"penalty state: sequence {sm.seq_ids[i]} samples with penalties but its state was never "
                    "sent (SamplingMetadata.penalty_reset) or was released; the engine core and the worker "
                    "are out of step"
                )
            idx.append(r)
        if reset:
            self._rebuild(sm, reset)
        (out,) = to_device([np.asarray(idx, dtype=np.int64)], self.device)
        return out

    def _rebuild(self, sm: SamplingMetadata, reset: list[int]) -> None:
        """Rows of ``reset`` from their token ids: zeroed, then the prompt mask set and the output counted."""
        v = self.vocab_size
        rows = np.asarray([self.row_of[sm.seq_ids[i]] for i in reset], dtype=np.int64)
        prompts = [sm.prompt_token_ids[i] or () for i in reset]
        outs = [sm.output_token_ids[i] or () for i in reset]
        p = np.full((len(reset), max(1, *(len(t) for t in prompts))), v, dtype=np.int64)
        o = np.full((len(reset), max(1, *(len(t) for t in outs))), v, dtype=np.int64)
        for j, (a, b) in enumerate(zip(prompts, outs, strict=True)):
            p[j, : len(a)], o[j, : len(b)] = a, b
        rows_t, p_t, o_t = to_device([rows, p, o], self.device)
        n = len(reset)
        counts = torch.zeros((n, v + 1), dtype=torch.int32, device=self.device)
        counts.scatter_add_(1, o_t, torch.ones(o_t.shape, dtype=torch.int32, device=self.device))
        mask = torch.zeros((n, v + 1), dtype=torch.bool, device=self.device)
        mask.scatter_(1, p_t, True)
        self.counts.index_copy_(0, rows_t, counts[:, :v])
        self.prompt.index_copy_(0, rows_t, mask[:, :v])

    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one to each state row ``rows`` ``[P]`` at its drawn token ``tokens`` ``[P]`` (int64, on the
        device): device ops only, no synchronization."""
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
