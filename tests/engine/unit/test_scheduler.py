"""The scheduler on its own (real KV cache manager, no model): token budget and chunked prefill, decode first,
admission order and head-of-line blocking, preemption victims per policy, LPM ordering and aging, capture
sizes."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest

from layerzero.engine.core.sequence import FinishReason

pytestmark = pytest.mark.unit
_IDS = itertools.count()


class _Live(NamedTuple):
    chunks: list
    preempted: list


def _seq(n, *, prio=0, t=0.0, tokens=None):
    from layerzero.engine import SamplingParams
    from layerzero.engine.core.sequence import Sequence

    rid = next(_IDS)
    # distinct tokens per sequence unless given: sequences sharing a first block form a prefix group (admitted
    # one cold member first), which only the prefix-group tests want
    ids = tokens if tokens is not None else list(range(1000 * rid + 1, 1000 * rid + n + 1))
    return Sequence(
        f"r{rid}", 0, list(ids), len(ids), SamplingParams(max_tokens=100), priority=prio, arrival_time=t
    )


def _sched(blocks=64, block_size=4, budget=16, max_seqs=8, policy="fcfs"):
    from layerzero.engine.core.kv import KVCacheManager
    from layerzero.engine.core.sched.policy import make_policy
    from layerzero.engine.core.sched.scheduler import Scheduler

    kv = KVCacheManager(blocks, block_size, watermark=0.0)
    return Scheduler(kv, make_policy(policy), max_num_seqs=max_seqs, max_num_batched_tokens=budget)


def _step(s, sample=True):
    s.schedule()
    out = _Live(s.scheduled, s.preempted)  # the live view of the plain-data output
    s.after_forward(out.chunks)
    for seq, _ in out.chunks:
        if sample and seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return out


def test_budget_chunks_a_long_prompt_and_decode_goes_first():
    s = _sched(budget=16)
    a, b = _seq(10, t=0), _seq(30, t=1)
    s.add(a), s.add(b)
    out = _step(s)
    assert [(q is a, n) for q, n in out.chunks] == [(True, 10), (False, 6)]  # b is chunked
    out = _step(s)
    assert [(q is a, n) for q, n in out.chunks] == [(True, 1), (False, 15)]  # a decodes first
    out = _step(s)
    assert [n for _, n in out.chunks] == [1, 9] and b.num_computed_tokens == 30


def test_admission_stops_at_the_first_request_that_does_not_fit():
    s = _sched(blocks=6, block_size=4, budget=100)
    big, small = _seq(20, t=0), _seq(3, t=1)  # big needs 5 blocks, then small 1: fits; a 2nd big would not
    s.add(big), s.add(small), s.add(_seq(20, t=2)), s.add(_seq(2, t=3))
    out = _step(s)
    assert [n for _, n in out.chunks] == [20, 3] and len(s.waiting) == 2


@pytest.mark.parametrize("policy,victim", [("fcfs", "third"), ("priority", "early")])
def test_preemption_victim(policy, victim):
    # 5 blocks of 4 tokens. early (4 tokens, prio 5), late (4, prio 0), third (7, prio -1) take 1 + 1 + 2
    # blocks; after one token each they need 2 + 2 + 3 blocks: the pool runs out in step 2. fcfs serves early,
    # late, third: early takes the last block, late fails -> the latest arrival (third) goes. priority serves
    # third, late, early: third takes the last block, late fails -> the lowest priority (early).
    s = _sched(blocks=5, block_size=4, budget=64, policy=policy)
    seqs = {"early": _seq(4, prio=5, t=0), "late": _seq(4, prio=0, t=1), "third": _seq(7, prio=-1, t=2)}
    for q in seqs.values():
        s.add(q)
    assert not _step(s).preempted
    out = _step(s)
    assert [next(k for k, q in seqs.items() if q is p) for p in out.preempted] == [victim]
    gone = seqs[victim]
    assert gone.num_computed_tokens == 0 and gone in s.waiting and gone.num_preemptions == 1
    assert sorted(n for _, n in out.chunks) == [1, 1]
    s.kv.check_invariants()


def test_lpm_prefers_the_cached_prefix_and_aging_bounds_waiting():
    from layerzero.engine.core.sched.policy import LPMPolicy

    shared = list(range(1, 13))
    old, hit = _seq(12, t=0.0, tokens=[50 + i for i in range(12)]), _seq(12, t=1.0, tokens=shared)
    cached = {id(old): 0, id(hit): 8}
    pol = LPMPolicy(aging_tokens_per_s=1.0)
    assert pol.order_waiting([old, hit], lambda q: cached[id(q)])[0] is hit
    pol = LPMPolicy(aging_tokens_per_s=1e6)  # one second of waiting outweighs any prefix
    assert pol.order_waiting([hit, old], lambda q: cached[id(q)])[0] is old


def test_capture_sizes():
    from layerzero.engine.worker.cuda_graph import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256


# ------------------------------------------------------------------------------------------ prefix groups
def test_a_prefix_group_admits_one_cold_member_then_the_rest_together():
    """Three requests sharing their first two blocks arrive with an unrelated one: the first member computes
    the prefix alone (its peers are skipped, the unrelated request is not blocked), then both peers are
    admitted in the same step and hit the cached blocks."""
    s = _sched(budget=64, block_size=4)
    shared = list(range(500, 508))
    a, b, c = (_seq(0, t=i, tokens=shared + [600 + 10 * i, 601 + 10 * i]) for i in range(3))
    other = _seq(6, t=3)
    for q in (a, b, c, other):
        s.add(q)
    out = _step(s)
    assert [q for q, _ in out.chunks] == [a, other]
    out = _step(s)
    admitted = [(q, n) for q, n in out.chunks if q in (b, c)]
    assert admitted == [(b, 2), (c, 2)] and b.num_cached_tokens == c.num_cached_tokens == 8
    s.kv.check_invariants()


def test_a_group_whose_prefix_is_cached_is_not_held_back():
    s = _sched(budget=64, block_size=4)
    shared = list(range(500, 508))
    first = _seq(0, tokens=shared + [1, 2])
    s.add(first)
    _step(s)  # computes and caches the two shared blocks
    b, c = _seq(0, t=1, tokens=shared + [3, 4]), _seq(0, t=2, tokens=shared + [5, 6])
    s.add(b), s.add(c)
    out = _step(s)
    assert {q for q, _ in out.chunks} >= {b, c} and b.num_cached_tokens == c.num_cached_tokens == 8


def test_prefix_groups_are_off_without_prefix_caching():
    from layerzero.engine.core.kv import KVCacheManager
    from layerzero.engine.core.sched.policy import make_policy
    from layerzero.engine.core.sched.scheduler import Scheduler

    s = Scheduler(
        KVCacheManager(64, 4, watermark=0.0, enable_prefix_caching=False),
        make_policy("lpm"),
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    shared = list(range(500, 508))
    seqs = [_seq(0, t=i, tokens=shared + [600 + i, 700 + i]) for i in range(3)]
    for q in seqs:
        s.add(q)
    assert [q for q, _ in _step(s).chunks] == seqs  # nothing to share: nobody waits


@pytest.mark.parametrize("large", [False, True], ids=["scored", "above-LPM_MAX_WAITING"])
def test_lpm_keeps_prefix_groups_together(monkeypatch, large):
    """Interleaved arrivals of three groups (g0 g1 g2 g0 g1 g2 ...): LPM admits them group by group, groups in
    the order of their earliest arrival, whether it scores every request or, above LPM_MAX_WAITING, only
    sorts."""
    from layerzero.engine.core.sched import policy as scheduling_policy

    if large:
        monkeypatch.setattr(scheduling_policy, "LPM_MAX_WAITING", 4)
    pol = scheduling_policy.LPMPolicy(aging_tokens_per_s=0.0)
    seqs = [_seq(0, t=float(i), tokens=[100 * (i % 3) + j for j in range(8)] + [900 + i]) for i in range(9)]
    order = pol.order_waiting(list(reversed(seqs)), lambda q: 0, lambda q: tuple(q.token_ids[:4]))
    assert [seqs.index(q) for q in order] == [0, 3, 6, 1, 4, 7, 2, 5, 8]
    # without keys (prefix caching off) it is arrival order
    assert pol.order_waiting(list(reversed(seqs)), lambda q: 0) == seqs


def _group(base, size, t0, block=4):
    """``size`` prompts sharing their first two blocks (tokens from ``base``), arrival times from ``t0``."""
    shared = list(range(base, base + 2 * block))
    return [_seq(0, t=t0 + i, tokens=shared + [base + 100 + i, base + 200 + i]) for i in range(size)]


def _run_until_done(s, limit=200):
    """Steps until nothing is left; the running set after each step."""
    seen = []
    for _ in range(limit):
        if not s.has_unfinished():
            break
        out = _step(s)
        for q, _ in out.chunks:
            if len(q.token_ids) - q.num_prompt_tokens >= 3:
                s.finish(q, FinishReason.LENGTH)
        seen.append(set(s.running))
    return seen


def test_lpm_starts_a_prefix_group_only_when_it_fits_whole():
    """Four slots, two groups of three: group A runs whole; group B (and a request without a prefix key queued
    after it) wait until B fits, then B runs whole; every request finishes."""

    s = _sched(budget=64, block_size=4, max_seqs=4, policy="lpm")
    a, b = _group(500, 3, 0.0), _group(700, 3, 10.0)
    lone = _seq(3, t=20.0)
    for q in (*a, *b, lone):
        s.add(q)
    seen = _run_until_done(s)
    assert not s.has_unfinished()
    for running in seen:
        assert not (running & set(a) and running & set(b))  # 3 + 3 > 4 slots: never together
    first_b = next(i for i, r in enumerate(seen) if r & set(b))
    assert all(not (r & {lone}) for r in seen[:first_b])  # nobody overtook the waiting group
    s.kv.check_invariants()


def test_fcfs_does_not_hold_groups_back():
    s = _sched(budget=64, block_size=4, max_seqs=4, policy="fcfs")
    a, b = _group(500, 3, 0.0), _group(700, 3, 10.0)
    for q in (*a, *b):
        s.add(q)
    _step(s)
    _step(s)  # a's peers (after its cold member) and b's cold member share the four slots
    assert set(s.running) & set(b)


def test_a_group_larger_than_half_the_slots_starts_at_half():
    """Eight slots, a group of ten: it starts once four slots are free (not never), next to a running
    request."""
    s = _sched(budget=200, block_size=4, max_seqs=8, policy="lpm")
    other = [_seq(5, t=float(i)) for i in range(4)]
    for q in other:
        s.add(q)
    _step(s)
    big = _group(500, 10, 10.0)
    for q in big:
        s.add(q)
    _step(s)
    assert set(s.running) & set(big)  # 4 free slots = half of 8: it starts
    _run_until_done(s)
    assert not s.has_unfinished()


def test_lpm_runs_few_whole_groups_where_fcfs_interleaves_many():
    """The shared-prefix benchmark's shape scaled down (8 groups x 8 requests arriving groups interleaved, 16
    slots): FCFS decodes 8 groups of 2 per step, LPM 2 whole groups of 8 (what lets cascade attention read 4x
    fewer prefixes per step), with the same number of steps and prefix hits."""
    results = {}
    for policy in ("fcfs", "lpm"):
        s = _sched(blocks=600, block_size=4, budget=64, max_seqs=16, policy=policy)
        prefixes = [[10_000 * (g + 1) + i for i in range(24)] for g in range(8)]
        group_of = {}
        for r in range(64):
            q = _seq(0, t=0.0, tokens=prefixes[r % 8] + [900_000 + 10 * r + i for i in range(4)])
            group_of[q.seq_id] = r % 8
            s.add(q)
        per_step, steps = [], 0
        while s.has_unfinished():
            out = _step(s)
            steps += 1
            if all(n == 1 for _, n in out.chunks):
                per_step.append(len({group_of[q.seq_id] for q, _ in out.chunks}))
            for q, _ in out.chunks:
                if len(q.token_ids) - q.num_prompt_tokens >= 12:
                    s.finish(q, FinishReason.LENGTH)
        results[policy] = (max(set(per_step), key=per_step.count), steps, s.kv.stats().hit_rate)
    assert results["fcfs"][0] == 8 and results["lpm"][0] == 2
    assert results["lpm"][1] <= results["fcfs"][1] and results["lpm"][2] >= results["fcfs"][2]
