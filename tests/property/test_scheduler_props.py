"""Property tests of the engine's scheduler (hypothesis; no model): random workloads of requests that share
prompt prefixes in groups, arriving over time, under every policy, prefix cache kind, pool, budget and slot
count. Each step keeps the scheduler's contract (slots, token budget, the KV manager's invariants, chunks of
at least one token), and every request finishes within a bound on the steps (no deadlock or starvation, in
particular from LPM's whole-group admission, which holds new groups back while their members do not fit)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.property

BLOCK = 4


@st.composite
def workloads(draw):
    """(requests as (prompt tokens, output tokens, arrival step), config)."""
    groups = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=5))
    reqs = []
    for g, (prefix_blocks, members) in enumerate(groups):
        prefix = [1000 * (g + 1) + i for i in range(prefix_blocks * BLOCK + draw(st.integers(0, BLOCK - 1)))]
        for _ in range(members):
            own = [50_000 + 100 * len(reqs) + i for i in range(draw(st.integers(1, 7)))]
            reqs.append((prefix + own, draw(st.integers(1, 5)), draw(st.integers(0, 6))))
    cfg = dict(
        policy=draw(st.sampled_from(["fcfs", "lpm", "priority"])),
        cache=draw(st.sampled_from(["radix", "hash", None])),
        max_seqs=draw(st.integers(1, 6)),
        budget=draw(st.integers(8, 40)),
    )
    need = max(-(-(len(p) + n) // BLOCK) for p, n, _ in reqs)  # one request's blocks at its longest
    cfg["blocks"] = draw(st.integers(need + 1, need + 40))
    return reqs, cfg


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_every_request_finishes_and_each_step_keeps_the_contract(w):
    from layerzero.engine import SamplingParams
    from layerzero.engine.core.kv import KVCacheManager
    from layerzero.engine.core.sched.policy import make_policy
    from layerzero.engine.core.sched.scheduler import Scheduler
    from layerzero.engine.core.sequence import FinishReason, Sequence

    reqs, cfg = w
    kv = KVCacheManager(
        cfg["blocks"],
        BLOCK,
        watermark=0.0,
        enable_prefix_caching=cfg["cache"] is not None,
        prefix_cache=cfg["cache"] or "radix",
    )
    s = Scheduler(
        kv, make_policy(cfg["policy"]), max_num_seqs=cfg["max_seqs"], max_num_batched_tokens=cfg["budget"]
    )
    pending = sorted(enumerate(reqs), key=lambda r: r[1][2])
    outputs: dict[int, int] = {}
    seqs = []
    total = sum(len(p) + n for p, n, _ in reqs)
    for step in range(10 * total + 50):
        while pending and pending[0][1][2] <= step:
            i, (prompt, n_out, _) = pending.pop(0)
            seq = Sequence(
                f"r{i}",
                0,
                list(prompt),
                len(prompt),
                SamplingParams(max_tokens=n_out),
                priority=i % 3,
                arrival_time=float(step) + i * 1e-6,
            )
            outputs[seq.seq_id] = n_out
            seqs.append(seq)
            s.add(seq)
        if not pending and not s.has_unfinished():
            break
        out = s.schedule()
        assert len(s.running) <= cfg["max_seqs"]
        assert out.num_batched_tokens <= cfg["budget"]
        assert all(n >= 1 for _, n in s.scheduled)
        s.after_forward()
        for q, _ in s.scheduled:
            if q.num_computed_tokens == q.num_tokens:
                q.token_ids.append(7)
                if len(q.token_ids) - q.num_prompt_tokens >= outputs[q.seq_id]:
                    s.finish(q, FinishReason.LENGTH)
        kv.check_invariants()
    assert not pending and not s.has_unfinished(), f"requests left after {step} steps: {cfg}"
    assert all(q.finish_reason is FinishReason.LENGTH for q in seqs)
