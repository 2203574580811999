"""Run ``layerzero bench-engine`` and write a results page: machine (CPU flags, GPU), versions, date, the
engine's output tokens / s, transformers' batched generate on the same checkpoint, the memory roofline, and
the engine's time split. See ``layerzero/engine/tools/bench.py`` for the workload (nano-vllm's) and the
roofline.

Usage::

    PYTHONPATH=src python benchmarks/engine/bench_engine.py --scale cpu --threads 1 \
        --out benchmarks/results/engine/cpu
    PYTHONPATH=src python benchmarks/engine/bench_engine.py --out benchmarks/results/engine/h200  # on the GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from layerzero.core.device import DeviceSpec
from layerzero.engine.tools.bench import default_checkpoint, run


def _machine(device: str) -> dict:
    cpu = DeviceSpec.detect(torch.device("cpu"))
    isa = cpu.cpu_isa
    flags = sorted(f for f in isa if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu.name or platform.machine(),
        "cpu_flags": flags,
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }


def profile(path: Path, device: str, out: Path) -> None:
    """torch.profiler tables (top 30 by device time) of a batch-1 decode and of a 64-request batch, written to
    ``out/profile_*.txt``: where the engine's GPU time goes, kernel by kernel."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from layerzero.engine import LLM, SamplingParams

    llm = LLM(path, device=device, dtype=torch.bfloat16, max_model_len=2048, max_num_seqs=64)
    runs = {"batch1": ([[7] * 256], 64), "batch64": ([[7 + i] * 256 for i in range(64)], 32)}
    for name, (prompts, new) in runs.items():
        sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=new)
        llm.generate(prompts, sp, use_tqdm=False)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with tprofile(activities=acts) as prof:
            llm.generate(prompts, sp, use_tqdm=False)
        sort = "device_time_total" if device.startswith("cuda") else "cpu_time_total"
        (out / f"profile_{name}.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
        )
        print(f"profile {name}: {out / f'profile_{name}.txt'}")


def main(argv: list[str] | None = None) -> int:
    """Run and write ``bench_engine.json`` and ``README.md`` to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=("full", "cpu"), default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--hf-batch",
        type=int,
        default=None,
        help="requests transformers generates at once (default: all of the cpu scale, 64 of the full one)",
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--profile", action="store_true", help="also write torch.profiler tables (profile_*.txt)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    scale = args.scale or ("full" if device.startswith("cuda") else "cpu")
    hf_batch = args.hf_batch if args.hf_batch is not None else (64 if scale == "full" else 16)
    res = run(scale=scale, device=device, hf_batch=hf_batch, out=args.out)
    res["machine"] = _machine(device)
    (args.out / "bench_engine.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    hf = res.get("transformers", {})
    t = res["engine_stats"]["time_s"]
    total = sum(t.values()) or 1.0
    lines = [
        f"# Engine throughput ({scale} scale, {res['device']}, {res['dtype']})",
        "",
        f"- date: {res['machine']['date']}; CPU {res['machine']['cpu']} (flags: "
        f"{', '.join(res['machine']['cpu_flags']) or 'n/a'}), GPU {res['machine']['gpu']}, torch "
        f"{res['machine']['torch']}, {res['machine']['threads']} torch threads",
        f"- workload: nano-vllm's bench.py ({res['requests']} requests, {res['output_tokens']} output "
        f"tokens; scale `{scale}`, see layerzero/engine/tools/bench.py)",
        "",
        "| run | output tok/s | notes |",
        "| --- | ---: | --- |",
        f"| layerzero.engine | {res['output_tokens_per_s']:.1f} | {res['seconds']:.2f} s, "
        f"{res['engine_stats']['steps']} steps, preemptions {res['engine_stats']['preemptions']} |",
    ]
    if hf:
        lines.append(
            f"| transformers generate, {hf['requests']} requests in one batch | "
            f"{hf['output_tokens_per_s']:.1f} | {hf['seconds']:.2f} s; {hf['note']} |"
        )
    b1 = res["batch1"]
    lines.append(
        f"| layerzero.engine, one request alone (greedy, {b1['prompt_tokens']}-token prompt) | "
        f"{b1['output_tokens_per_s']:.1f} | {b1['output_tokens']} tokens in {b1['seconds']:.2f} s; decode "
        f"after the first token {b1['decode_tokens_per_s']:.1f} tok/s ({b1['first_token_ms']:.1f} ms to it) |"
    )
    lines += [
        f"| memory roofline | {res['roofline_tokens_per_s']:.0f} | copy bandwidth "
        f"{res['copy_bandwidth_gb_s']:.1f} GB/s; the engine reaches {100 * res['fraction_of_roofline']:.1f}% "
        "|",
        "",
        "Engine time split: " + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f}%)" for k, v in t.items()),
    ]
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.profile:
        dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
        profile(default_checkpoint(scale, dt), device, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
