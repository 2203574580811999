"""The engine's part of ``make demo``: build a small checkpoint here (a scaled-down Qwen3 config with seeded
random weights and a byte-level BPE tokenizer trained with ``tokenizers``), load it with the real loader,
generate a batch of prompts, check the greedy tokens against transformers' ``generate``, stream one
completion, and print the engine's statistics.

Run: ``python -m layerzero.engine.tools.demo [--family qwen3|llama|qwen3_moe] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import LLM, SamplingParams

PROMPTS = ("The quick brown fox", "Hello world, the engine serves", "Paged attention with prefix caching and")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 0 when the engine's greedy tokens equal transformers', else 1."""
    from layerzero.testing.checkpoints import build_checkpoint
    from layerzero.testing.hf_models import load

    ap = argparse.ArgumentParser(
        prog="python -m layerzero.engine.tools.demo", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--family", default="qwen3", choices=("qwen3", "llama", "qwen3_moe"))
    ap.add_argument(
        "--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(args.family, args.dir or Path(tmp) / args.family)
        print(
            f"engine demo: {args.family} checkpoint at {path} "
            f"({', '.join(sorted(p.name for p in path.iterdir()))})"
        )
        llm = LLM(path, device="cpu", dtype=torch.float32, max_model_len=128, num_kv_blocks=64)
        # min_tokens bans EOS like transformers' min_new_tokens below, so both run the full length
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
        outs = llm.generate(list(PROMPTS), greedy, use_tqdm=False)
        hf = load(args.family, path)
        ok = True
        for o in outs:
            with torch.no_grad():
                ref = hf.generate(
                    torch.tensor([o.prompt_token_ids]),
                    max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            same = ref[0, len(o.prompt_token_ids) :].tolist() == o.outputs[0].token_ids
            ok &= same
            print(
                f"  {o.prompt!r} -> {o.outputs[0].text!r}  [{len(o.outputs[0].token_ids)} tokens, "
                f"{'= transformers' if same else 'DIFFERS from transformers'}]"
            )
        print("  streamed (temperature 0.8, seed 0): ", end="")
        for delta in llm.stream(PROMPTS[0], SamplingParams(temperature=0.8, seed=0, max_tokens=16)):
            print(delta.outputs[0].text, end="", flush=True)
        print(f"  [{delta.outputs[0].finish_reason}]")
        s = llm.stats()
        print(
            f"  stats: {s['steps']} steps, {s['prompt_tokens']} prompt + {s['generation_tokens']} generated "
            f"tokens, prefix hit rate {100 * s['prefix_hit_rate']:.0f}%, {s['num_kv_blocks']} KV blocks"
        )
    print("engine parity: OK" if ok else "engine parity: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
