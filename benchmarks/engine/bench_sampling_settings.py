"""Output tok/s of one engine under each sampling setting, relative to all-greedy (issue 39 section 1: every
setting >= 0.9x all-greedy on the H200).

One process, one ``LLM`` on a Llama-3.2-1B-shaped config (published config.json values,
``load_format="dummy"``: seeded random weights, no download), 512 requests with ShareGPT-like lengths
(``bench_serve``'s ``SHAREGPT_INPUT`` / ``SHAREGPT_OUTPUT`` lognormals, seed 0; token ids uniform in
``[3, 10000)``; ``ignore_eos`` so every setting generates the same tokens count). A warm-up runs every setting
on a few requests (kernels compile there, not in the timed runs); then every setting runs the whole workload,
in two rounds, the second in reverse order (drift in the machine shows as a gap between the rounds). Reported:
each round's output tok/s, their mean, and the ratio of the mean to all-greedy's mean, as a markdown table and
JSON under ``--out`` with the machine (CPU, CPU flags, GPU), versions and date.

Usage::

    PYTHONPATH=src python benchmarks/engine/bench_sampling_settings.py --out benchmarks/results/sampling/h200
    PYTHONPATH=src python benchmarks/engine/bench_sampling_settings.py --tiny --out /tmp/sampling  # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}
"""The published meta-llama/Llama-3.2-1B config.json (weights here are random)."""
TINY = {
    **LLAMA_3_2_1B,
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""A CPU smoke-test shape (same architecture, tiny)."""


def settings(n: int, vocab: int) -> dict[str, list[dict[str, Any]]]:
    """Setting name -> per-request ``SamplingParams`` keyword arguments (``n`` requests; ``max_tokens`` and
    ``ignore_eos`` added by the caller). The issue's table plus logit bias and ``logprobs=5``."""
    t = {"temperature": 0.8}
    bias = {int(i): 1.5 for i in np.random.default_rng(1).choice(vocab, 16, replace=False)}
    one = {
        "all-greedy": {"temperature": 0.0},
        "temperature 0.8": t,
        "+ top_p 0.95": {**t, "top_p": 0.95},
        "+ top_k 50": {**t, "top_k": 50},
        "+ min_p 0.05": {**t, "min_p": 0.05},
        "presence_penalty 0.3": {**t, "presence_penalty": 0.3},
        "repetition_penalty 1.1 (greedy)": {"temperature": 0.0, "repetition_penalty": 1.1},
        "logit_bias (16 tokens, greedy)": {"temperature": 0.0, "logit_bias": bias},
        "logprobs=5 (greedy)": {"temperature": 0.0, "logprobs": 5},
    }
    out = {name: [kw] * n for name, kw in one.items()}
    out["seeded top_p 0.95"] = [{**t, "top_p": 0.95, "seed": i} for i in range(n)]
    mix = [{"temperature": 0.0}, {**t, "top_p": 0.95}, {**t, "top_k": 50, "presence_penalty": 0.3}]
    out["mix (1/3 greedy, top_p, top_k + presence)"] = [mix[i % 3] for i in range(n)]
    return out


def workload(n: int, tiny: bool) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts (token ids) and output lengths, ShareGPT-like (seed 0); shrunk for ``tiny``."""
    from layerzero.engine.tools.bench_serve import SHAREGPT_INPUT, SHAREGPT_OUTPUT, LengthDistribution

    rng = np.random.default_rng(0)
    inp, outp = (
        (LengthDistribution(24, 1.0, 4, 64), LengthDistribution(12, 1.0, 4, 32))
        if tiny
        else (
            SHAREGPT_INPUT,
            SHAREGPT_OUTPUT,
        )
    )
    lens, outs = inp.sample(rng, n), outp.sample(rng, n)
    hi = 1000 if tiny else 10000
    return [rng.integers(3, hi, size=k).tolist() for k in lens], outs


def machine(device: str) -> dict[str, Any]:
    """CPU, CPU flags, GPU, versions, date."""
    from layerzero.core.device import DeviceSpec

    cpu = DeviceSpec.detect(torch.device("cpu"))
    flags = sorted(f for f in cpu.cpu_isa if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import layerzero

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu.name or platform.machine(),
        "cpu_flags": flags,
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "layerzero": layerzero.__version__,
        "python": platform.python_version(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, warm up, time every setting in two alternated rounds; returns the results dict."""
    from layerzero.engine import LLM, SamplingParams

    model_dir = Path(tempfile.mkdtemp(prefix="lz-sampling-shape-"))
    shape = TINY if args.tiny else LLAMA_3_2_1B
    (model_dir / "config.json").write_text(json.dumps(shape, indent=2) + "\n")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    opts: dict[str, Any] = dict(device=device, load_format="dummy", seed=0, max_num_seqs=args.max_num_seqs)
    if args.tiny:
        opts.update(dtype=torch.float32, max_model_len=128, num_kv_blocks=128, max_num_batched_tokens=256)
    else:
        opts.update(dtype=torch.bfloat16, max_model_len=2048)
    llm = LLM(str(model_dir), **opts)
    prompts, max_tokens = workload(args.num_prompts, args.tiny)
    table = settings(args.num_prompts, shape["vocab_size"])
    if args.only:
        table = {k: v for k, v in table.items() if k in args.only or k == "all-greedy"}

    def params(name: str, k: int | None = None) -> list[SamplingParams]:
        rows = table[name] if k is None else table[name][:k]
        return [
            SamplingParams(**kw, max_tokens=m, ignore_eos=True)
            for kw, m in zip(rows, max_tokens, strict=False)
        ]

    warm = min(len(prompts), args.warmup_prompts)
    for name in table:  # compile every setting's kernels outside the timed runs
        llm.generate(prompts[:warm], params(name, warm), use_tqdm=False)
    names = list(table)
    rounds: dict[str, list[float]] = {n: [] for n in names}
    for order in (names, names[::-1]):
        for name in order:
            ps = params(name)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, ps, use_tqdm=False)
            dt = time.perf_counter() - t0
            toks = sum(len(c.token_ids) for o in outs for c in o.outputs)
            rounds[name].append(toks / dt)
            print(f"{name:45s} {toks / dt:10.1f} tok/s", file=sys.stderr, flush=True)
    base = float(np.mean(rounds["all-greedy"]))
    rows = [
        {
            "setting": n,
            "tok_s_rounds": rounds[n],
            "tok_s": float(np.mean(rounds[n])),
            "ratio_to_greedy": float(np.mean(rounds[n])) / base,
        }
        for n in names
    ]
    return {
        "machine": machine(device),
        "model": "tiny llama" if args.tiny else "Llama-3.2-1B shape (dummy weights, bf16)",
        "num_prompts": len(prompts),
        "output_tokens": sum(max_tokens),
        "engine_options": {k: str(v) for k, v in opts.items()},
        "rows": rows,
    }


def markdown(res: dict[str, Any]) -> str:
    """The results as a markdown page: the table (setting, tok/s per round, mean, ratio) and the machine."""
    m = res["machine"]
    lines = [
        "# Output tok/s per sampling setting (issue 39 section 1)",
        "",
        f"{res['model']}; {res['num_prompts']} ShareGPT-like requests, {res['output_tokens']} output tokens "
        "each run; two rounds, the second in reverse order; ratio = mean / all-greedy mean (target >= 0.9).",
        "",
        "| setting | round 1 tok/s | round 2 tok/s | mean tok/s | / all-greedy |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        a, b = r["tok_s_rounds"]
        lines.append(
            f"| {r['setting']} | {a:.0f} | {b:.0f} | {r['tok_s']:.0f} | {r['ratio_to_greedy']:.2f} |"
        )
    lines += ["", "Machine: " + "; ".join(f"{k}: {v}" for k, v in m.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the flags, run, write ``results.json`` and ``results.md`` under ``--out``; returns them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for results.json and results.md")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny llama and a tiny workload")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per run (512; --tiny: 8)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--warmup-prompts", type=int, default=64, help="requests per setting in the warm-up")
    ap.add_argument("--only", nargs="*", default=None, help="settings to run (all-greedy always runs)")
    args = ap.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 8 if args.tiny else 512
    if args.tiny:
        args.warmup_prompts = min(args.warmup_prompts, 2)
    res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
