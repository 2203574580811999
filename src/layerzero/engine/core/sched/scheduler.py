"""Continuous batching under one token budget per step, with chunked prefill, admission by free KV blocks and
preemption by recompute (vLLM v1's unified scheduler: every sequence simply has tokens whose KV is not
computed yet; decode is the case of one such token; with async scheduling that token may still be pending on
the device).

Each step: running sequences first (in policy order), each gets ``min(uncomputed tokens, budget left)``
tokens; when the pool cannot hold them, the policy's victim among the not-yet-scheduled running sequences is
preempted (its blocks are freed, its full blocks stay in the prefix cache as evictable, its computed count
drops to 0 and it waits again, keeping its arrival time). Then, if nothing was preempted, waiting sequences
are admitted in policy order while the budget, ``max_num_seqs`` and the pool (keeping a watermark of free
blocks while any sequence runs; an idle engine admits up to the whole pool) allow; a sequence that does not
fit stops admission for this step (no overtaking, so no starvation). A prompt longer than the budget is
prefilled in chunks over several steps. With prefix caching, the completions of one request (``n > 1``) are
admitted one first: the others wait until its prompt is computed and then reuse its full blocks. Likewise for
different requests that share their first block (a prefix group): while a member that found none of it cached
(a cold member) prefills, the group's other waiting members are skipped, not blocking admission, and are
admitted once its blocks are cached instead of computing the same prefix in the same step (SGLang's in-batch
prefix caching check).

A sequence whose request asked for prompt logprobs (``Sequence.prompt_lp``) and does not have them all yet is
admitted without prefix-cache hits (vLLM's rule: cached tokens have no logits, so its prompt is computed
again), and its chunks' prompt positions are named in ``SchedulerOutput.prompt_logprobs``.

Copy-on-write forks (beam search; :meth:`Scheduler.add` with ``fork_of``): a forked sequence is admitted
with the block table :meth:`KVCacheManager.fork` gives it (the parent's full blocks shared by refcount, a new
block for the partial last one, whose copy goes in ``SchedulerOutput.blocks_to_copy``) and the parent's first
``num_tokens`` tokens counted as computed (no prefix-cache lookup); it computes only its tokens after them.
When that cannot be done (too few free blocks for the copy and its new tokens, the parent's KV gone) it falls
back to the ordinary admission (its tokens through the prefix cache; logged). A sequence marked ``retain_kv``
keeps its block table when it finishes, until :meth:`Scheduler.release` (forks are made from such parents).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

from ..kv.block_manager import KVCacheManager
from ..sequence import FinishReason, Sequence, SequenceStatus
from .output import SchedulerOutput, penalty_state_sent
from .policy import SchedulingPolicy

__all__ = ["Scheduler", "SchedulerOutput"]

log = logging.getLogger("layerzero.engine")


class Scheduler:
    """Waiting and running sequences over one :class:`KVCacheManager`."""

    def __init__(
        self, kv: KVCacheManager, policy: SchedulingPolicy, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.kv, self.policy = kv, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        #: The last :meth:`schedule`'s chunks (live sequence, new tokens) in batch order, and the sequences it
        #: preempted: the engine core's view of the step its plain-data output describes.
        self.scheduled: list[tuple[Sequence, int]] = []
        self.preempted: list[Sequence] = []
        #: The last :meth:`schedule`'s prompt-logprob chunks (live sequence, first position), in the order of
        #: its ``SchedulerOutput.prompt_logprobs`` (usually empty).
        self.prompt_logprobs: list[tuple[Sequence, int]] = []
        #: Speculative decoding's host side (a :class:`~layerzero.engine.spec_decode.SpecDecodeState`), or
        #: None: a decoding sequence whose ``drafts`` it gives is scheduled with its last token and its k
        #: drafts (k + 1 positions, slots allocated for all of them; ``Sequence.spec_token_ids``).
        self.spec: Any = None
        #: Finished sequences whose penalty state the workers hold: sent (``SamplingMetadata.free_seq_ids``)
        #: with the next step that runs.
        self.freed_penalty_state: list[int] = []
        #: Copy-on-write forks waiting for admission: child seq_id -> (parent sequence, its tokens shared).
        self.forks: dict[int, tuple[Sequence, int]] = {}
        #: Sequences whose block table outlives their finish until :meth:`release` (seq_ids).
        self.retained: set[int] = set()
        self._copies: list[tuple[int, int]] = []  # the next output's blocks_to_copy

    def add(
        self, seq: Sequence, *, fork_of: tuple[Sequence, int] | None = None, retain_kv: bool = False
    ) -> None:
        """Queue a new sequence. ``fork_of`` (parent, num_tokens): admit it as a copy-on-write fork of the
        parent's first ``num_tokens`` tokens (the caller checked that they are ``seq``'s first tokens and that
        the parent is retained); ``retain_kv``: keep its block table after it finishes (:meth:`release`)."""
        seq.status = SequenceStatus.WAITING
        if fork_of is not None:
            self.forks[seq.seq_id] = fork_of
        if retain_kv:
            self.retained.add(seq.seq_id)
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        """Stop retaining ``seq``'s block table: freed now when it finished (full blocks stay cached), else
        when it finishes. Waiting forks of it fall back to the ordinary admission."""
        self.retained.discard(seq.seq_id)
        if seq.finished and seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)
        for child, (parent, _) in list(self.forks.items()):
            if parent is seq:
                del self.forks[child]
                log.info("fork of sequence %d: parent released before admission; prefilled instead", child)

    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running ``seq`` by recompute: its blocks are freed (full ones stay cached), its computed
        count drops to 0 and it waits again, keeping its arrival time."""
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        self.forks.pop(seq.seq_id, None)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        seq.spec_token_ids = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """The next step as plain data (no chunks when nothing can run); its live chunks and preempted
        sequences are :attr:`scheduled` and :attr:`preempted` until the next call."""
        out = _Live()
        self._schedule(out)
        self.scheduled, self.preempted = out.chunks, out.preempted
        return self._plain(out.chunks, out.preempted)

    def _plain(self, chunks: list[tuple[Sequence, int]], preempted: list[Sequence]) -> SchedulerOutput:
        """The plain-data :class:`SchedulerOutput` of ``chunks`` (one pass; the block tables one gather)."""
        out = SchedulerOutput(preempted_seq_ids=[s.seq_id for s in preempted])
        out.blocks_to_copy, self._copies = self._copies, []
        self.prompt_logprobs = []
        if not chunks:
            return out
        rids, sids, starts, lens, ids, pend, sample = (
            out.req_ids,
            out.seq_ids,
            out.num_computed_tokens,
            out.num_scheduled_tokens,
            out.new_token_ids,
            out.pending_src,
            out.sample,
        )
        sm = out.sampling
        spec_ids = out.spec_token_ids if self.spec is not None else None
        plp: list[tuple[Sequence, int]] = []
        for i, (seq, n) in enumerate(chunks):
            start = seq.num_computed_tokens
            last = start + n >= seq.num_tokens  # > with drafts (speculative decoding)
            if seq.prompt_lp is not None and not seq.prompt_lp.done:
                end = min(start + n, seq.num_prompt_tokens - 1)  # the prompt's last position samples
                if end > start:
                    out.prompt_logprobs.add(i, seq.prompt_lp.top_n, seq.token_ids[start + 1 : end + 1])
                    plp.append((seq, start))
            rids.append(seq.request_id)
            sids.append(seq.seq_id)
            starts.append(start)
            lens.append(n)
            drafts = seq.spec_token_ids
            if drafts is None:
                ids.append(seq.token_ids[start : start + n])  # a pending last token is not in token_ids
            else:  # the last token, then the drafts (a draft model's -1: filled on the device)
                ids.append([*seq.token_ids[start : start + 1], *(max(d, 0) for d in drafts)])
            if spec_ids is not None:
                spec_ids.append([] if drafts is None else list(drafts))
            pend.append(seq.pending_index if last else None)
            sample.append(last)
            if last:
                sm.add(seq)
        if self.freed_penalty_state:
            sm.free_seq_ids, self.freed_penalty_state = self.freed_penalty_state, []
        out.block_tables = self.kv.block_tables(sids)
        self.prompt_logprobs = plp
        return out

    def _schedule(self, out: _Live) -> None:
        """Fill ``out`` with the next step's chunks and preemptions."""
        budget = self.max_num_batched_tokens
        self.running.sort(key=self.policy.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.length_capped:  # async scheduling: its pending token ends it; nothing more to compute
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            seq.spec_token_ids = None
            if self.spec is not None and n == 1 == seq.num_uncomputed_tokens and not seq.num_pending:
                drafts = self.spec.drafts(seq, budget)
                # the drafts' slots; when the pool cannot hold them the sequence decodes one token
                if (
                    drafts
                    and self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + 1 + len(drafts))
                    is not None
                ):
                    seq.spec_token_ids = drafts
                    n += len(drafts)
            while self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + n) is None:
                victim = self.policy.victim(self.running[i:])
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append((seq, n))
                budget -= n
                i += 1
        if out.preempted:
            return
        if budget <= 0 or len(self.running) >= self.max_num_seqs or not self.waiting:
            return  # no room: the policy's order (prefix lookups for LPM) is not needed
        # completions of one request (n > 1) share the prompt, members of a prefix group its first block(s):
        # while one computes them, the others wait (skipped, not blocking admission) and then find them in the
        # prefix cache
        share = self.kv.enable_prefix_caching
        prefilling: set[Hashable] = set()
        keys: dict[int, Hashable | None] = {}  # seq_id -> prefix key, computed once for this step
        if share:
            keys = {s.seq_id: self._prefix_key(s) for s in (*self.running, *self.waiting)}
            for s in self.running:
                if s.num_computed_tokens < s.num_prompt_tokens:
                    prefilling.add(s.request_id)
                    if s.num_cached_tokens < self.kv.block_size:
                        prefilling.add(keys[s.seq_id])
        key_of = (lambda s: keys[s.seq_id]) if share else None
        groups = _WholeGroups(self, key_of) if key_of is not None and self.policy.whole_groups else None
        for seq in self.policy.order_waiting(self.waiting, self._cached_tokens, key_of):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            key = keys.get(seq.seq_id)
            if self.forks and seq.seq_id in self.forks:
                n = self._admit_fork(seq, budget)
                if n is not None:
                    out.chunks.append((seq, n))
                    budget -= n
                    continue
            if seq.num_preemptions == 0 and (
                seq.request_id in prefilling or key is not None and key in prefilling
            ):
                continue
            if seq.num_pending:  # preempted with a token in flight: admitted once its id is known (next step)
                continue
            if groups is not None and not groups.admits(key):
                continue  # a new prefix group waits for room for all its members (see _WholeGroups)
            recompute = seq.prompt_lp is not None and not seq.prompt_lp.done  # its prompt needs logits
            blocks, cached = (
                ([], 0) if recompute else self.kv.get_computed_blocks(seq.token_ids, record=False)
            )
            n = min(seq.num_tokens - cached, budget)
            # the watermark keeps blocks free for running sequences: with none running it would only block (a
            # prompt that needs more than the pool minus the watermark never starts)
            if self.kv.allocate_slots(seq.seq_id, cached + n, blocks, admit=bool(self.running)) is None:
                break
            if not recompute:
                self.kv.get_computed_blocks(seq.token_ids)  # counts the admitted lookup in the hit rate
            self.waiting.remove(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, cached
            seq.num_cached_tokens = max(seq.num_cached_tokens, cached) if seq.num_preemptions else cached
            self.running.append(seq)
            out.chunks.append((seq, n))
            budget -= n
            if share:
                prefilling.add(seq.request_id)
                if cached < self.kv.block_size and key is not None:
                    prefilling.add(key)

    def _admit_fork(self, seq: Sequence, budget: int) -> int | None:
        """Admit the waiting fork ``seq`` from its parent's block table (:meth:`KVCacheManager.fork`; the
        partial block's copy queued for the output) with its first ``min(uncomputed, budget)`` tokens to
        compute; returns that count, or None (logged; the fork is dropped) when it must be admitted the
        ordinary way: the parent's KV is gone or the pool cannot hold the copy and the new tokens."""
        parent, num = self.forks.pop(seq.seq_id)
        n = min(seq.num_tokens - num, budget)
        bs = self.kv.block_size
        need = (num % bs > 0) + max(0, -(-(num + n) // bs) - -(-num // bs))
        if parent.seq_id not in self.kv or parent.num_computed_tokens < num:
            why = "the parent's KV is no longer held"
        elif not self.kv.can_allocate(need, admit=bool(self.running)):
            why = f"{need} free blocks needed, {self.kv.num_free_blocks()} left"
        else:
            self._copies += self.kv.fork(parent.seq_id, seq.seq_id, num)
            self.kv.allocate_slots(seq.seq_id, num + n)  # fits: checked above
            self.waiting.remove(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status, seq.num_computed_tokens, seq.num_cached_tokens = SequenceStatus.RUNNING, num, num
            self.running.append(seq)
            return n
        log.info(
            "fork of sequence %d from %d: %s; admitted through the prefix cache",
            seq.seq_id,
            parent.seq_id,
            why,
        )
        return None

    def _cached_tokens(self, seq: Sequence) -> int:
        if seq.prompt_lp is not None and not seq.prompt_lp.done:
            return 0  # admitted without prefix-cache hits
        return self.kv.get_computed_blocks(seq.token_ids, record=False)[1]

    def _prefix_key(self, seq: Sequence) -> Hashable | None:
        """The prompt's first block of tokens (its prefix group), or None when the prompt has no full block
        before its last token (nothing of it can be cached)."""
        if seq.num_prompt_tokens <= self.kv.block_size:
            return None
        return ("prefix", *seq.token_ids[: self.kv.block_size])

    def after_forward(self, chunks: list[tuple[Sequence, int]] | None = None) -> None:
        """Count each chunk's tokens as computed (``chunks``: a step's :attr:`scheduled`, by default the last
        one) and register the blocks they filled in the prefix cache (a sequence that finished meanwhile,
        async scheduling's late stop, is skipped: its blocks are freed)."""
        for seq, n in self.scheduled if chunks is None else chunks:
            if seq.finished or seq.spec_token_ids is not None:  # verified rows: after_verify
                continue
            seq.num_computed_tokens += n
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def after_verify(self, chunks: list[tuple[Sequence, int]]) -> None:
        """After a step's tokens were appended: each speculating chunk of ``chunks`` counts as computed only
        its last token and its accepted drafts (every known token but the new last one; the rejected
        positions' KV is overwritten later) and registers the blocks they filled in the prefix cache."""
        for seq, _ in chunks:
            if seq.spec_token_ids is None:
                continue
            seq.spec_token_ids = None
            if seq.finished:
                continue
            seq.num_computed_tokens = len(seq.token_ids) - 1
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End ``seq``: free its blocks (full ones stay cached) and drop it from the queues."""
        seq.spec_token_ids = None
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if penalty_state_sent(seq):
            self.freed_penalty_state.append(seq.seq_id)
        self.forks.pop(seq.seq_id, None)
        if seq.seq_id in self.kv and seq.seq_id not in self.retained:
            self.kv.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


class _Live:
    """A step being scheduled: chunks (live sequence, new tokens) and the sequences preempted."""

    __slots__ = ("chunks", "preempted")

    def __init__(self) -> None:
        self.chunks: list[tuple[Sequence, int]] = []
        self.preempted: list[Sequence] = []


class _WholeGroups:
    """One step's admission of whole prefix groups (policies with ``whole_groups``, LPM): a group with no
    running member starts only when the free sequence slots, minus those its running groups' waiting members
    will take, hold all its waiting members (at most half of ``max_num_seqs``: a larger group starts at half
    and fills in). Otherwise a wave's slots go to the first members of many groups and each group spreads over
    several waves, so every decode step holds many groups of few members: cascade attention then reads many
    prefixes per step (the shared-prefix benchmark: 64 groups x 4 members per step in arrival order, 16 x 16
    whole, ``benchmarks/engine/prefix_schedule_sim.py``). Once a new group does not fit, no other new group or
    request without a prefix key is admitted in the step (only members of running groups, whose slots are
    booked), so the free slots only grow until it fits: no starvation (an empty batch always admits)."""

    def __init__(self, sched: Scheduler, key_of: Callable[[Sequence], Hashable | None]) -> None:
        self.sched = sched
        self.waiting: dict[Hashable, int] = {}  # waiting members per prefix key
        for s in sched.waiting:
            k = key_of(s)
            if k is not None:
                self.waiting[k] = self.waiting.get(k, 0) + 1
        self.running = {key_of(s) for s in sched.running}
        self.reserved = sum(self.waiting.get(k, 0) for k in self.running if k is not None)
        self.blocked = False

    def admits(self, key: Hashable | None) -> bool:
        """Whether a waiting sequence with prefix ``key`` may be admitted now; when it may, its slot (a new
        group: its waiting members' slots) is booked and the caller admits it (or, out of KV blocks, stops
        admitting for the step); when not, the caller skips it."""
        s = self.sched
        if key is not None and key in self.running:
            self.reserved -= 1  # one of the booked members
            return True
        need = 1 if key is None else min(self.waiting.get(key, 1), max(1, s.max_num_seqs // 2))
        if self.blocked or s.running and s.max_num_seqs - len(s.running) - self.reserved < need:
            self.blocked = True
            return False
        if key is None:
            return True
        self.running.add(key)
        self.reserved += self.waiting.get(key, 1) - 1
        return True
