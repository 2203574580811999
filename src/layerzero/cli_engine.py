"""The engine's subcommands of the ``layerzero`` command line: ``generate`` (stream one completion from a
checkpoint with the serving engine) and ``bench-engine`` (nano-vllm's throughput benchmark, or the
prefix-caching workload). :func:`add_parsers` adds them to ``layerzero.cli``'s parser.

Kept apart from the library's subcommands (``cli.py``: ``doctor``, ``explain``, ``tune``, ...): they are the
only code outside the engine that imports it (DESIGN.md, "The engine"); the imports are inside the commands,
so building the parser (``layerzero --help``, ``layerzero doctor``) does not import the engine.

``generate`` exits 1 when the request fails inside a step (the reason on stderr); LayerZero errors exit 2
(``layerzero.cli.main``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["ENGINE_DTYPES", "add_parsers"]

ENGINE_DTYPES = ("float32", "float16", "bfloat16")
"""``--dtype`` of the engine commands: the names of ``layerzero.engine.config.DTYPES`` (what
``LLM(dtype=...)`` accepts; float64 is not one: the engine's kernels and KV pool run in these)."""


def _chat_prompt(tok: Any, text: str, model: str) -> list[int]:
    """The token ids of ``text`` as one user message in the tokenizer's chat template (generation prompt
    added).

    Raises:
        InvalidInputError: the checkpoint has no tokenizer or no chat template; the template fails.
    """
    from layerzero.engine.errors import bad_input

    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_input(
            "--chat",
            "a checkpoint whose tokenizer has a chat template",
            f"{'no tokenizer' if tok is None else 'a tokenizer without a chat template'} in {model}",
            "Drop --chat and pass the prompt already formatted.",
        )
    try:
        out = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
    except Exception as exc:  # jinja2's and the tokenizer's errors
        raise bad_input(
            "--chat", "a prompt the chat template accepts", f"{type(exc).__name__}: {exc}"
        ) from exc
    return list(out["input_ids"])


def _cmd_generate(ns: argparse.Namespace) -> int:
    """Stream one completion to stdout with the serving engine."""
    import torch

    from layerzero.engine import LLM, SamplingParams

    dtype = None if ns.dtype == "auto" else getattr(torch, ns.dtype)
    llm = LLM(ns.model, device=ns.device, dtype=dtype, max_model_len=ns.max_model_len)
    params = SamplingParams(
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        max_tokens=ns.max_tokens,
        seed=ns.seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )
    prompt = ns.prompt
    if ns.chat:
        prompt = _chat_prompt(llm.tokenizer, prompt, ns.model)
    last = None
    for delta in llm.stream(prompt, params):
        print(delta.outputs[0].text, end="", flush=True)
        last = delta
    print()
    if last is not None:
        print(f"[finish_reason={last.outputs[0].finish_reason}]", file=sys.stderr)
        if last.error is not None:  # failed inside a step (finish_reason "error"): say why, exit non-zero
            print(f"layerzero: error: {last.error}", file=sys.stderr)
            return 1
    return 0


def _cmd_bench_engine(ns: argparse.Namespace) -> int:
    """nano-vllm's benchmark through the engine (see layerzero.engine.bench)."""
    import torch

    from layerzero.engine.config import resolve_device
    from layerzero.engine.tools.bench import run

    resolve_device(ns.device)  # a bad --device is a ConfigurationError before any checkpoint is built
    scale = ns.scale or ("full" if torch.cuda.is_available() and ns.device != "cpu" else "cpu")
    if ns.workload == "prefix":
        from layerzero.engine.tools.bench_prefix import run_prefix

        r = run_prefix(
            scale=scale,
            model=ns.model,
            device=ns.device,
            repeats=ns.repeats,
            zero_hit=not ns.no_zero_hit,
            dtype=None if ns.dtype == "auto" else getattr(torch, ns.dtype),
        )
        sp, zh = r["shared_prefix"], r["zero_hit"]
        print(
            f"shared prefix ({sp['requests']} requests): {sp['seconds_cache_on']:.2f} s with prefix caching, "
            f"{sp['seconds_cache_off']:.2f} s without: {sp['speedup']:.2f}x (hit rate "
            f"{100 * sp['hit_rate']:.0f}%)"
        )
        if "seconds_cache_on_cascade" in sp:
            print(
                f"  prefix caching + cascade attention: {sp['seconds_cache_on_cascade']:.2f} s: "
                f"{sp['speedup_cascade']:.2f}x ({sp['cascade_steps']} cascade steps)"
            )
            print(
                f"  prefix caching + cascade attention + scheduling_policy='lpm': "
                f"{sp['seconds_cache_on_cascade_lpm']:.2f} s: {sp['speedup_cascade_lpm']:.2f}x (hit rate "
                f"{100 * sp['hit_rate_cascade_lpm']:.0f}%)"
            )
        if zh is not None:
            print(
                f"0% hits ({zh['requests']} requests): {zh['seconds_cache_on']:.2f} s on, "
                f"{zh['seconds_cache_off']:.2f} s off: cost {100 * zh['cost']:+.1f}% (median of "
                f"{len(zh['pair_costs'])} interleaved pairs: "
                + ", ".join(f"{100 * c:+.1f}%" for c in zh["pair_costs"])
                + ")"
            )
        if ns.out is not None:
            ns.out.mkdir(parents=True, exist_ok=True)
            (ns.out / "bench_prefix.json").write_text(json.dumps(r, indent=2) + "\n")
        return 0
    res = run(
        scale=scale,
        model=ns.model,
        device=ns.device,
        dtype=ns.dtype,
        hf_batch=ns.hf_batch,
        out=ns.out,
        enforce_eager=ns.enforce_eager,
    )
    hf = res.get("transformers", {})
    print(
        f"engine: {res['output_tokens']} tokens in {res['seconds']:.2f} s = {res['output_tokens_per_s']:.1f} "
        f"tok/s ({100 * res['fraction_of_roofline']:.1f}% of the {res['roofline_tokens_per_s']:.0f} tok/s "
        "roofline)"
    )
    if hf:
        print(
            f"transformers generate ({hf['requests']} requests batched): {hf['output_tokens_per_s']:.1f} "
            "tok/s"
        )
    b1 = res["batch1"]
    print(
        f"one request alone ({b1['prompt_tokens']}-token prompt, {b1['output_tokens']} greedy tokens): "
        f"{b1['output_tokens_per_s']:.1f} tok/s; decode after the first token "
        f"{b1['decode_tokens_per_s']:.1f} tok/s ({b1['first_token_ms']:.1f} ms to it)"
    )
    return 0


def add_parsers(sub: Any) -> None:
    """Add ``generate`` and ``bench-engine`` to ``sub`` (the ``add_subparsers`` action of the ``layerzero``
    parser)."""
    g = sub.add_parser("generate", help="stream a completion from a checkpoint with the serving engine")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", nargs="*", default=None, help="stop strings")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", choices=("auto", *ENGINE_DTYPES), default="auto")
    g.set_defaults(fn=_cmd_generate)
    be = sub.add_parser(
        "bench-engine", help="nano-vllm's throughput benchmark vs transformers and the roofline"
    )
    be.add_argument(
        "--scale", choices=("full", "cpu"), default=None, help="default: full on CUDA, cpu otherwise"
    )
    be.add_argument(
        "--model", default=None, help="checkpoint (default: a Qwen3-0.6B-shaped random one, cached)"
    )
    be.add_argument("--device", default=None)
    be.add_argument("--dtype", choices=("auto", *ENGINE_DTYPES), default="auto")
    be.add_argument(
        "--hf-batch", type=int, default=64, help="requests transformers generates in one batch (0: skip)"
    )
    be.add_argument("--enforce-eager", action="store_true")
    be.add_argument(
        "--workload",
        choices=("nano-vllm", "prefix"),
        default="nano-vllm",
        help="prefix: shared-prefix speed-up and the cost of prefix caching at a 0%% hit rate",
    )
    be.add_argument(
        "--no-zero-hit",
        action="store_true",
        help="prefix workload: skip the 0%%-hit measurement (only the shared-prefix runs)",
    )
    be.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="prefix workload: interleaved on/off pairs of the 0%%-hit run (the cost is their median)",
    )
    be.add_argument("--out", type=Path, default=None, help="write bench_engine.json here")
    be.set_defaults(fn=_cmd_bench_engine)
