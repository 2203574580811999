"""The scheduler on its own (real KV cache manager, no model): token budget and chunked prefill, decode first,
admission order and head-of-line blocking, preemption victims per policy, LPM ordering and aging, capture sizes."""

from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.unit
_IDS = itertools.count()


def _seq(n, *, prio=0, t=0.0, tokens=None):
    from layerzero.engine import SamplingParams
    from layerzero.engine.sequence import Sequence

    ids = tokens if tokens is not None else list(range(1, n + 1))
    return Sequence(f"r{next(_IDS)}", 0, list(ids), len(ids), SamplingParams(max_tokens=100), priority=prio, arrival_time=t)


def _sched(blocks=64, block_size=4, budget=16, max_seqs=8, policy="fcfs"):
    from layerzero.engine.kv import KVCacheManager
    from layerzero.engine.scheduler import Scheduler
    from layerzero.engine.scheduling_policy import make_policy

    kv = KVCacheManager(blocks, block_size, watermark=0.0)
    return Scheduler(kv, make_policy(policy), max_num_seqs=max_seqs, max_num_batched_tokens=budget)


def _step(s, sample=True):
    out = s.schedule()
    s.after_forward(out)
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
    # 5 blocks of 4 tokens. early (4 tokens, prio 5), late (4, prio 0), third (7, prio -1) take 1 + 1 + 2 blocks;
    # after one token each they need 2 + 2 + 3 blocks: the pool runs out in step 2.
    # fcfs serves early, late, third: early takes the last block, late fails -> the latest arrival (third) goes.
    # priority serves third, late, early: third takes the last block, late fails -> the lowest priority (early).
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
    from layerzero.engine.scheduling_policy import LPMPolicy

    shared = list(range(1, 13))
    old, hit = _seq(12, t=0.0, tokens=[50 + i for i in range(12)]), _seq(12, t=1.0, tokens=shared)
    cached = {id(old): 0, id(hit): 8}
    pol = LPMPolicy(aging_tokens_per_s=1.0)
    assert pol.order_waiting([old, hit], lambda q: cached[id(q)])[0] is hit
    pol = LPMPolicy(aging_tokens_per_s=1e6)  # one second of waiting outweighs any prefix
    assert pol.order_waiting([hit, old], lambda q: cached[id(q)])[0] is old


def test_capture_sizes():
    from layerzero.engine.runner.cuda_graph import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
