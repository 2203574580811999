"""Scheduling policies: the order waiting sequences are admitted in, and which running sequence is preempted
when the KV pool runs out. (Not "policy.py": in LayerZero that word means kernel policy.)

- ``fcfs``: arrival order; the latest arrival is preempted first (vLLM's default).
- ``priority``: lower ``priority`` value first, then arrival; the highest value (latest arrival on ties) is
  preempted first (vLLM's priority scheduling).
- ``lpm``: longest prefix match first (SGLang's cache-aware policy: requests that reuse the most cached KV go
  first), with aging: a request's score is its cached-prefix tokens plus ``aging_tokens_per_s`` per second waited,
  so a request waits at most about ``max_model_len / aging_tokens_per_s`` seconds behind later arrivals. Above
  ``LPM_MAX_WAITING`` waiting requests the prefix lookups cost too much per step and the order is FCFS (as SGLang).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .errors import bad_config
from .sequence import Sequence

__all__ = ["LPM_MAX_WAITING", "SchedulingPolicy", "make_policy"]

LPM_MAX_WAITING = 128


class SchedulingPolicy:
    """FCFS: admission in arrival order, preemption of the latest arrival."""

    name = "fcfs"

    def sort_key(self, seq: Sequence) -> tuple:
        """Admission order of waiting sequences and the order running ones are served in (smallest first)."""
        return (seq.arrival_time, seq.seq_id)

    def order_waiting(self, waiting: list[Sequence], cached_tokens: Callable[[Sequence], int]) -> list[Sequence]:
        """Waiting sequences in admission order (``cached_tokens(seq)``: its prefix-cache hit in tokens)."""
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

    def __init__(self, aging_tokens_per_s: float = 1000.0) -> None:
        self.aging = aging_tokens_per_s

    def order_waiting(self, waiting: list[Sequence], cached_tokens: Callable[[Sequence], int]) -> list[Sequence]:
        """Highest ``cached tokens + aging x seconds waited`` first; FCFS above :data:`LPM_MAX_WAITING`."""
        if len(waiting) > LPM_MAX_WAITING:
            return sorted(waiting, key=self.sort_key)
        now = time.monotonic()
        score = {s.seq_id: cached_tokens(s) + self.aging * (now - s.arrival_time) for s in waiting}
        return sorted(waiting, key=lambda s: (-score[s.seq_id], s.arrival_time, s.seq_id))


def make_policy(name: str) -> SchedulingPolicy:
    """The policy called ``name`` (``fcfs``, ``lpm``, ``priority``).

    Raises:
        ConfigurationError: another name.
    """
    policies = {"fcfs": SchedulingPolicy, "lpm": LPMPolicy, "priority": PriorityPolicy}
    if name not in policies:
        raise bad_config("scheduling_policy", f"one of {sorted(policies)}", repr(name))
    return policies[name]()
