"""Where one request's time to first token goes (issue 37's offline TTFT target: <= 8 ms up to 1,024 prompt
tokens, never slower for a shorter prompt), on the full-scale Qwen3-0.6B checkpoint (bf16), one warm ``LLM``:

- TTFT per prompt length: ``generate`` of one request with ``max_tokens=1``, median of ``--repeats`` after
  three warm calls, and the engine's own split of it (``llm.stats()``: schedule / forward / sample / ...);
- for each length in ``--profile-lengths``, torch.profiler of one such request: CUDA kernels launched and
  their summed device time, host synchronizations (count and time), the top host ops by self CPU time;
- cProfile of one request of the shortest length: the Python functions with the most own time.

``--piecewise N`` builds the engine with ``CudaGraphKnobs(piecewise_max_tokens=N)`` (0: eager prefill).
Run once per setting, each in a fresh process, to compare them.

Usage: ``PYTHONPATH=src python benchmarks/engine/ttft_breakdown.py --out DIR [--piecewise 512]`` (CUDA).
Writes ``DIR/ttft_piecewise<N>.md``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from layerzero.engine import LLM, SamplingParams
from layerzero.engine.config import CudaGraphKnobs
from layerzero.engine.tools.bench import default_checkpoint

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def ttft_ms(llm: LLM, prompt: list[int], repeats: int) -> tuple[float, dict[str, float]]:
    """Median ms of ``repeats`` one-token requests after three warm ones, and the engine's split of one
    request (ms per stage, from ``llm.engine.stats.time_s``)."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for _ in range(3):
        llm.generate([prompt], sp, use_tqdm=False)
    stats = llm.engine.stats.time_s
    before = dict(stats)
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        times.append(1e3 * (time.perf_counter() - t0))
    split = {k: 1e3 * (stats[k] - before.get(k, 0.0)) / repeats for k in stats}
    return statistics.median(times), split


def profile_lines(llm: LLM, prompt: list[int]) -> list[str]:
    """torch.profiler of one one-token request: kernels, device time, host syncs, top host ops."""
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    acts = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if llm.engine.runner.device.type == "cuda" else []
    )
    with profile(activities=acts) as prof:
        llm.generate([prompt], sp, use_tqdm=False)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    syncs = [e for e in events if any(e.name.startswith(s) for s in SYNCS)]
    launches = [e for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")]
    replays = [e for e in events if e.name == "cudaGraphLaunch"]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return [
        f"### {len(prompt)}-token prompt under torch.profiler",
        "",
        f"- kernels on the GPU: {len(kernels)}, {sum(e.device_time for e in kernels) / 1e3:.2f} ms summed",
        f"- kernel launches from the host: {len(launches)}; graph launches: {len(replays)}",
        f"- host syncs / copies ({', '.join(SYNCS)}): {len(syncs)}, "
        f"{sum(e.cpu_time for e in syncs) / 1e3:.2f} ms",
        "",
        "```",
        table,
        "```",
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--piecewise", type=int, default=0)
    ap.add_argument("--lengths", default="16,32,64,256,512,1024,3000")
    ap.add_argument("--profile-lengths", default="32,1024")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run on the 2-layer CPU-scale checkpoint")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    llm = LLM(
        default_checkpoint("full" if cuda else "cpu", dtype),
        device=a.device,
        dtype=dtype,
        max_model_len=4096 if cuda else 2048,
        max_num_seqs=64,
        cuda_graph=CudaGraphKnobs(piecewise_max_tokens=a.piecewise),
    )
    startup = time.perf_counter() - t0
    lengths = [int(x) for x in a.lengths.split(",")]
    prompts = {n: [7 + (i * 37) % 9000 for i in range(n)] for n in lengths}
    pieces = llm.engine.runner.pieces
    lines = [
        f"# Time to first token on {torch.cuda.get_device_name() if cuda else 'CPU'} (Qwen3-0.6B shape, "
        f"{str(dtype).removeprefix('torch.')}, one request, max_tokens 1), "
        f"piecewise_max_tokens {a.piecewise}",
        "",
        f"- torch {torch.__version__}; start-up {startup:.1f} s; piecewise buckets: "
        f"{pieces.sizes if pieces is not None else 'off'}",
        "",
        "| prompt tokens | TTFT median (ms) | engine split per request (ms) |",
        "| ---: | ---: | --- |",
    ]
    for n in lengths:
        ms, split = ttft_ms(llm, prompts[n], a.repeats)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in split.items() if v >= 0.005)
        lines.append(f"| {n} | {ms:.2f} | {parts} |")
        print(lines[-1], flush=True)
    lines.append("")
    for n in (int(x) for x in a.profile_lengths.split(",")):
        lines += profile_lines(llm, prompts.get(n) or [7 + (i * 37) % 9000 for i in range(n)])
    prof = cProfile.Profile()
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prof.enable()
    llm.generate([prompts[min(lengths)]], sp, use_tqdm=False)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    lines += [f"## cProfile of one {min(lengths)}-token request (own time)", "", "```", s.getvalue(), "```"]
    (a.out / f"ttft_piecewise{a.piecewise}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
