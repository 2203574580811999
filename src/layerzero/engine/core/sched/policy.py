"""Scheduling policies: the order waiting sequences are admitted in, and which running sequence is preempted
when the KV pool runs out. (Not "policy.py": in LayerZero that word means kernel policy.)

- ``fcfs``: arrival order; the latest arrival is preempted first (vLLM's default).
- ``priority``: lower ``priority`` value first, then arrival; the highest value (latest arrival on ties) is
  preempted first (vLLM's priority scheduling).
- ``lpm``: longest prefix match first (SGLang's cache-aware policy: requests that reuse the most cached KV go
  first), with aging: a request's score is its cached-prefix tokens plus ``aging_tokens_per_s`` per second
  waited, so a request waits at most about ``max_model_len / aging_tokens_per_s`` seconds behind later
  arrivals. Requests that share their first block (a prefix group) are scored by one lookup, their earliest
  member's (members diverging after the first block may then rank above their own hit; admission uses each
  one's real hit), and equal scores keep a group together (groups ordered by their earliest arrival). Above
  ``LPM_MAX_WAITING`` waiting requests the prefix lookups cost too much per step (SGLang falls back to FCFS
  there): the order is then FCFS by prefix group, i.e. requests sharing their first block are admitted
  together, groups in the order of their earliest waiting request (one sort by a key of the first block's
  tokens, no cache lookup).

Grouping matters for shared prompts: a batch that holds a few groups of many members reads each shared prefix
once per group with cascade attention (``runner/cascade.py``) and fills its steps with cache hits, where
arrival order interleaves many groups of few members. The scheduler admits one cold member of a group first
and the others once its blocks are cached (``scheduler.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from ...errors import bad_config
from ..sequence import Sequence

__all__ = ["LPM_MAX_WAITING", "SchedulingPolicy", "make_policy"]

LPM_MAX_WAITING = 128


class SchedulingPolicy:
    """FCFS: admission in arrival order, preemption of the latest arrival."""

    name = "fcfs"
    whole_groups = False
    """Start a prefix group only when all its waiting members fit the free sequence slots (see
    ``scheduler.py``)."""

    def sort_key(self, seq: Sequence) -> tuple:
        """Admission order of waiting sequences and the order running ones are served in (smallest first)."""
        return (seq.arrival_time, seq.seq_id)

    def order_waiting(
        self,
        waiting: list[Sequence],
        cached_tokens: Callable[[Sequence], int],
        prefix_key: Callable[[Sequence], Hashable | None] | None = None,
    ) -> list[Sequence]:
        """Waiting sequences in admission order (``cached_tokens(seq)``: its prefix-cache hit in tokens;
        ``prefix_key(seq)``: a key of its first block's tokens, None without one or without prefix
        caching)."""
        return sorted(waiting, key=self.sort_key)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The running sequence to preempt among ``candidates`` (served last)."""
        return max(candidates, key=self.sort_key)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, then arrival."""

    name = "priority"

    def sort_key(self, seq: Sequence) -> tuple:
        """(priority, arrival, id)."""
        return (seq.priority, seq.arrival_time, seq.seq_id)


class LPMPolicy(SchedulingPolicy):
    """Longest prefix match with aging (see the module docstring)."""

    name = "lpm"
    whole_groups = True

    def __init__(self, aging_tokens_per_s: float = 1000.0) -> None:
        self.aging = aging_tokens_per_s

    def order_waiting(
        self,
        waiting: list[Sequence],
        cached_tokens: Callable[[Sequence], int],
        prefix_key: Callable[[Sequence], Hashable | None] | None = None,
    ) -> list[Sequence]:
        """Highest ``cached tokens + aging x seconds waited`` first, equal scores by prefix group; FCFS by
        prefix group above :data:`LPM_MAX_WAITING` (see the module docstring)."""
        group = _group_arrivals(waiting, prefix_key)
        if len(waiting) > LPM_MAX_WAITING:
            return sorted(waiting, key=lambda s: (group[s.seq_id], s.arrival_time, s.seq_id))
        now = time.monotonic()
        hits: dict[tuple[float, int], int] = {}  # one prefix lookup per group: its earliest member's
        by_id = {s.seq_id: s for s in waiting}
        for g in set(group.values()):
            hits[g] = cached_tokens(by_id[g[1]])
        score = {s.seq_id: hits[group[s.seq_id]] + self.aging * (now - s.arrival_time) for s in waiting}
        return sorted(waiting, key=lambda s: (-score[s.seq_id], group[s.seq_id], s.arrival_time, s.seq_id))


def _group_arrivals(
    waiting: list[Sequence], prefix_key: Callable[[Sequence], Hashable | None] | None
) -> dict[int, tuple[float, int]]:
    """seq_id -> (arrival, seq_id) of the earliest waiting sequence with the same prefix key (its own without
    a key): sorting by it keeps the members of a group together, groups in arrival order."""
    keys = {s.seq_id: prefix_key(s) if prefix_key is not None else None for s in waiting}
    first: dict[Hashable, tuple[float, int]] = {}
    for s in waiting:
        key = keys[s.seq_id]
        if key is not None and (key not in first or (s.arrival_time, s.seq_id) < first[key]):
            first[key] = (s.arrival_time, s.seq_id)
    return {
        s.seq_id: (s.arrival_time, s.seq_id) if keys[s.seq_id] is None else first[keys[s.seq_id]]
        for s in waiting
    }


def make_policy(name: str) -> SchedulingPolicy:
    """The policy called ``name`` (``fcfs``, ``lpm``, ``priority``).

    Raises:
        ConfigurationError: another name.
    """
    policies = {"fcfs": SchedulingPolicy, "lpm": LPMPolicy, "priority": PriorityPolicy}
    if name not in policies:
        raise bad_config("scheduling_policy", f"one of {sorted(policies)}", repr(name))
    return policies[name]()
