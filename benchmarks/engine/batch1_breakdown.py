"""Where one request's decode step goes (batch 1, greedy, CUDA graphs) on the full-scale Qwen3-0.6B
checkpoint:

- the whole step (``generate`` wall time / tokens) and the engine's own split (schedule / forward / sample /
  detokenize, from ``llm.stats()``);
- the decode graph's replay alone (CUDA events over back-to-back replays): the GPU's share of a step;
- the host's share by function (cProfile of one ``generate``, top entries by own time).

Usage: ``PYTHONPATH=src python benchmarks/engine/batch1_breakdown.py --out DIR`` (CUDA). Writes
``DIR/batch1_breakdown.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

from layerzero.engine import LLM, SamplingParams
from layerzero.engine.tools.bench import default_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch1_ab import replay_us as batch1_replay_us  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    path = default_checkpoint("full", torch.bfloat16)
    llm = LLM(path, device="cuda", dtype=torch.bfloat16, max_model_len=2048, max_num_seqs=16)
    prompt = [7 + (i * 37) % 9000 for i in range(256)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=a.tokens)
    llm.generate([prompt], sp, use_tqdm=False)
    eng = llm.engine
    before = {k: v for k, v in eng.stats.time_s.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    split = {k: (eng.stats.time_s[k] - before[k]) / a.tokens * 1e6 for k in before}
    graphs = eng.runner.graphs
    replay_us = float("nan")
    if graphs is not None:
        replay_us = batch1_replay_us(graphs.graphs[1])
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], sp, use_tqdm=False)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
    lines = [
        f"# Batch-1 decode step on {torch.cuda.get_device_name()} (Qwen3-0.6B shape, bf16, greedy, "
        f"256-token prompt, {a.tokens} new tokens)",
        "",
        f"- whole step: {wall / a.tokens * 1e6:.0f} µs ({a.tokens / wall:.0f} tok/s)",
        "- engine split per token (µs): " + ", ".join(f"{k} {v:.0f}" for k, v in split.items()),
        f"- decode graph replay alone (batch 1, back to back): {replay_us:.0f} µs",
        "",
        "## cProfile of one generate (own time)",
        "",
        "```",
        s.getvalue(),
        "```",
    ]
    (a.out / "batch1_breakdown.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
