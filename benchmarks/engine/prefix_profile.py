"""Where the shared-prefix benchmark's time goes (``layerzero bench-engine --workload prefix``'s cached runs):

- the wall time of each engine step, by kind: steps with prefill tokens, plain decode steps, cascade decode
  steps (with async scheduling a step's wall time is mostly the GPU time of the step launched before it);
- a ``torch.profiler`` table of a window of decode steps in the middle of the run (GPU kernels by total time);
- which kernel served each eager ``lz`` call, per step kind, and every fallback (``lz.trace``): a step kind
  that is slow on one machine only shows there whether another kernel ran (2026-11-25: LPM without cascade
  took ~1 s per step with prefill tokens on two machines and ~45 ms on others; the kernels were not recorded
  then).

The workload is the benchmark's (``shared_prefix_workload("full")``, groups interleaved), cut to its first
``--requests`` requests (256: one wave, 64 groups x 4 members, as the full run's waves are), with prefix
caching on, once with ``cascade_attention`` off and once on.

Usage: ``PYTHONPATH=src python benchmarks/engine/prefix_profile.py --out DIR [--requests 256] [--policy
lpm]`` (CUDA). Writes ``DIR/prefix_profile.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

import layerzero as lz
from layerzero.engine import LLM, SamplingParams
from layerzero.engine.tools.bench import default_checkpoint
from layerzero.engine.tools.bench_prefix import shared_prefix_workload, warm_up


def profile_run(
    path: Path,
    prompts: list[list[int]],
    out_tokens: int,
    cascade: bool,
    window: tuple[int, int],
    rows: int,
    device: torch.device,
    kind: str = "decode",
    policy: str = "fcfs",
) -> list[str]:
    """One cached run; returns its report lines (step times by kind, the profiler's table over the steps
    ``window`` = (first, count) of ``kind``: "decode" counts pure decode steps (cascade or not), "prefill"
    steps with prefill tokens)."""
    cuda = device.type == "cuda"
    llm = LLM(
        path,
        device=str(device),
        dtype=torch.bfloat16 if cuda else torch.float32,
        max_model_len=len(prompts[0]) + out_tokens + 16,
        cascade_attention=cascade,
        scheduling_policy=policy,
    )
    warm_up(llm)  # the benchmark's warm-up: every kind of step, so no first-use compile is timed
    eng = llm.engine
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step, times = eng.step, {"prefill": [], "decode": [], "cascade": []}
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts)
    mixed: list[str] = []  # prefill + decode tokens: ms, of every step with prefill tokens
    kernels: dict[str, Counter] = {
        k: Counter() for k in times
    }  # (op, kernel) calls per step kind (eager calls)
    fallbacks: Counter = Counter()
    state = {"counted": 0, "last": 0.0, "profiling": False}

    def timed_step():  # noqa: ANN202
        before = eng.runner.cascade_steps
        if state["counted"] == window[0] and not state["profiling"]:
            prof.start()
            state["profiling"] = True
        with lz.trace() as tr:
            res = step()
        now = time.perf_counter()
        st = eng.stats.last_step
        step_kind = (
            "prefill"
            if st.num_prefill_tokens
            else "cascade"
            if eng.runner.cascade_steps > before
            else "decode"
        )
        kernels[step_kind].update(tr.counts)
        fallbacks.update(str(f) for f in tr.fallbacks)
        times[step_kind].append(now - state["last"])
        if step_kind == "prefill":
            mixed.append(f"{st.num_prefill_tokens}+{st.num_decode_tokens}:{1e3 * (now - state['last']):.0f}")
        state["last"] = now
        if (step_kind == "prefill") == (kind == "prefill"):
            state["counted"] += 1
            if state["profiling"] and state["counted"] == window[0] + window[1]:
                sync()
                prof.stop()
                state["profiling"] = False
        return res

    eng.step = timed_step
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_tokens)
    sync()
    base_steps, base_cascade, kv0 = (
        eng.stats.steps,
        eng.runner.cascade_steps,
        eng.kv.stats(),
    )  # after the warm-up
    t0 = state["last"] = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    total = time.perf_counter() - t0
    kv1 = eng.kv.stats()
    hit = (kv1.hits - kv0.hits) / max(1, kv1.queries - kv0.queries)
    lines = [
        f"## cascade_attention={cascade}, scheduling_policy={policy!r}: {total:.2f} s, "
        f"{eng.stats.steps - base_steps} steps ({eng.runner.cascade_steps - base_cascade} cascade, prefill "
        f"steps included), prefix hit rate {hit:.1%}",
        "",
        "| step kind | steps | total s | mean ms | median ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, ts in times.items():
        if ts:
            lines.append(
                f"| {name} | {len(ts)} | {sum(ts):.2f} | {1e3 * sum(ts) / len(ts):.2f} "
                f"| {1e3 * statistics.median(ts):.2f} |"
            )
    lines += [
        "",
        "steps with prefill tokens (prefill + decode tokens: ms): " + " ".join(mixed),
        "",
        f"engine time split (s): {eng.stats.time_s}",
        "",
        "kernels of the eager lz calls per step kind (op, kernel: calls; CUDA-graph replays make none): "
        + "; ".join(
            f"{k}: " + ", ".join(f"{op} {kid}: {n}" for (op, kid), n in sorted(c.items()))
            for k, c in kernels.items()
            if c
        ),
        "",
        f"fallbacks: {dict(fallbacks) or 'none'}",
        "",
        f"profiler, {kind} steps {window[0]}..{window[0] + window[1] - 1}:",
        "",
        "```",
        prof.key_averages().table(
            sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=rows, max_name_column_width=70
        )
        if prof.profiler is not None
        else "(window not reached)",
        "```",
        "",
    ]
    del llm
    if cuda:
        torch.cuda.empty_cache()
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--window", type=int, nargs=2, default=(100, 6), metavar=("FIRST", "COUNT"))
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument(
        "--kind", default="decode", choices=("decode", "prefill"), help="the steps --window counts"
    )
    ap.add_argument("--modes", default="off,on", help="cascade_attention runs, in order: off,on")
    ap.add_argument("--policy", default="fcfs", choices=("fcfs", "lpm", "priority"), help="scheduling_policy")
    ap.add_argument(
        "--scale",
        default="full",
        choices=("full", "cpu"),
        help="cpu: the CPU scale on the CPU (a smoke test of this script)",
    )
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if a.scale == "full" else "cpu")
    prompts, out_tokens = shared_prefix_workload(a.scale)
    prompts = prompts[: a.requests]
    path = default_checkpoint(a.scale, torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lines = [
        f"# shared-prefix profile: {a.requests} requests, {name}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
        "",
    ]
    for mode in a.modes.split(","):
        lines += profile_run(
            path, prompts, out_tokens, mode == "on", tuple(a.window), a.rows, device, a.kind, a.policy
        )
    (a.out / "prefix_profile.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
