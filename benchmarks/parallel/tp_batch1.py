"""Where one request's decode step goes at a tensor-parallel size (batch 1, greedy, CUDA graphs): the step's
wall time, the engine's split (schedule / forward / sample / detokenize per token), rank 0's GPU kernels
(torch.profiler: device time per step by kernel, the collectives included) and rank 0's host functions
(cProfile). With ``--tp`` > 1 the other ranks' host profile is written by the worker processes
(``LAYERZERO_WORKER_PROFILE``) when the engine shuts down.

    PYTHONPATH=src:benchmarks python benchmarks/parallel/tp_batch1.py --model /tmp/shapes/qwen3-8b \\
        --tp 2 --out DIR      # config.json-only directory: load_format="dummy"

Writes ``DIR/tp<N>_batch1.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ["LAYERZERO_WORKER_PROFILE"] = str(a.out / f"tp{a.tp}_worker")
    from torch.profiler import ProfilerActivity, profile

    from layerzero.engine import LLM, SamplingParams

    llm = LLM(
        a.model,
        device="cuda",
        dtype=torch.bfloat16,
        load_format=a.load_format,
        tensor_parallel_size=a.tp,
        max_model_len=2048,
        max_num_seqs=64,
    )
    prompt = [7 + (i * 37) % 9000 for i in range(256)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=a.tokens)
    llm.generate([prompt], sp, use_tqdm=False)
    eng = llm.engine
    before = dict(eng.stats.time_s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    split = {k: (eng.stats.time_s[k] - before[k]) / a.tokens * 1e6 for k in before}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(
            [prompt], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64), use_tqdm=False
        )
    kernels = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=25, max_name_column_width=70
    )
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    gpu_us_per_step = sum(e.self_device_time_total for e in events) / 64
    host = cProfile.Profile()
    host.enable()
    llm.generate([prompt], sp, use_tqdm=False)
    host.disable()
    s = io.StringIO()
    pstats.Stats(host, stream=s).sort_stats("tottime").print_stats(35)
    stats = llm.stats()
    llm.shutdown()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [
        f"# Batch-1 decode at TP = {a.tp}: {Path(a.model).name} ({date})",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}. Prompt 256 tokens, {a.tokens} greedy "
        "tokens.",
        "",
        f"- step: {wall / a.tokens * 1e6:.0f} µs ({a.tokens / wall:.1f} tok/s, first token included)",
        "- engine split per token (µs): " + ", ".join(f"{k} {v:.0f}" for k, v in split.items()),
        f"- rank 0 GPU kernel time per step: {gpu_us_per_step:.0f} µs (64-token profiled run)",
        f"- weights: {stats['weights_bytes'] / 1e9:.2f} GB per rank, loaded in "
        f"{stats['weights_load_s']:.2f} s; "
        f"start-up {stats['startup_s']:.1f} s (warm-up {stats['warmup_s']:.1f} s)",
        "",
        "## Rank 0 kernels (64 steps)",
        "",
        "```",
        kernels,
        "```",
        "",
        "## Rank 0 host (cProfile, one generate)",
        "",
        "```",
        s.getvalue()[:12000],
        "```",
    ]
    (a.out / f"tp{a.tp}_batch1.md").write_text("\n".join(text) + "\n")
    print("\n".join(text[:9]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
