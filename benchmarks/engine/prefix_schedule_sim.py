"""What the scheduler alone makes of the shared-prefix benchmark (no model, no device: seconds on a CPU).

Runs the real :class:`~layerzero.engine.core.sched.scheduler.Scheduler` and KV cache manager over
``shared_prefix_workload("full")`` (1024 requests, 64 groups x 16 sharing a 2048-token prefix, 128-token
questions, 256 output tokens) with the H200 run's pool (39,169 blocks of 16), budget (8,192) and
``max_num_seqs`` (256), one sampled token per finished chunk, and reports per policy: steps, steps with
prefill tokens, the prefix hit rate, and for the decode steps the groups per step, i.e. how many 2048-token
prefixes cascade attention's shared level reads per layer per step (the decode step's largest cost on the
H200, benchmarks/results/engine/h200/README.md).

Usage: ``PYTHONPATH=src python benchmarks/engine/prefix_schedule_sim.py [--policies fcfs lpm]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from layerzero.engine import SamplingParams
from layerzero.engine.core.kv import KVCacheManager
from layerzero.engine.core.sched.policy import make_policy
from layerzero.engine.core.sched.scheduler import Scheduler
from layerzero.engine.core.sequence import FinishReason, Sequence
from layerzero.engine.tools.bench_prefix import PREFIX_SCALES, shared_prefix_workload


def simulate(
    policy: str, blocks: int = 39169, block_size: int = 16, budget: int = 8192, max_seqs: int = 256
) -> dict[str, float]:
    """One run of the scheduler over the full shared-prefix workload; the counts described in the module
    docstring."""
    prompts, out_tokens = shared_prefix_workload("full")
    prefix = PREFIX_SCALES["full"]["prefix"]
    kv = KVCacheManager(blocks, block_size, watermark=0.01)
    s = Scheduler(kv, make_policy(policy), max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    group = {}
    for i, p in enumerate(prompts):
        seq = Sequence(f"r{i}", 0, list(p), len(p), SamplingParams(max_tokens=out_tokens), arrival_time=0.0)
        group[seq.seq_id] = tuple(p[:prefix])
        s.add(seq)
    steps = mixed = 0
    groups_per_decode, t0 = [], time.perf_counter()
    while s.has_unfinished():
        s.schedule()
        s.after_forward()
        steps += 1
        if any(n > 1 for _, n in s.scheduled):
            mixed += 1
        else:
            groups_per_decode.append(len({group[q.seq_id] for q, _ in s.scheduled}))
        for q, _ in s.scheduled:
            if q.num_computed_tokens == q.num_tokens:
                q.token_ids.append(7)
                if len(q.token_ids) - q.num_prompt_tokens >= out_tokens:
                    s.finish(q, FinishReason.LENGTH)
    st = kv.stats()
    return {
        "steps": steps,
        "steps_with_prefill": mixed,
        "hit_rate": st.hit_rate,
        "decode_groups_mean": statistics.fmean(groups_per_decode),
        "decode_groups_median": statistics.median(groups_per_decode),
        "host_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=["fcfs", "lpm"])
    a = ap.parse_args(argv)
    print(
        "| policy | steps | steps with prefill | prefix hit rate | prefixes per decode step (mean / median) "
        "| scheduler host s |\n| --- | ---: | ---: | ---: | ---: | ---: |"
    )
    for p in a.policies:
        r = simulate(p)
        print(
            f"| {p} | {r['steps']} | {r['steps_with_prefill']} | {r['hit_rate']:.1%} | "
            f"{r['decode_groups_mean']:.1f} / {r['decode_groups_median']:.0f} | {r['host_s']:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
