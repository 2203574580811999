"""The engine's subcommands of the ``layerzero`` command line: ``generate`` (run prompts through the serving
engine as one batch), ``serve`` (the OpenAI-compatible server), ``bench-engine`` (nano-vllm's throughput
benchmark, or the prefix-caching workload) and ``bench-serve`` (vLLM's online benchmark against any
OpenAI-compatible server). :func:`add_parsers` adds them to ``layerzero.cli``'s parser;
:func:`add_engine_args` and :func:`engine_kwargs` are the engine flags ``generate`` and ``serve`` share (every
``LLM`` option).

Kept apart from the library's subcommands (``cli.py``: ``doctor``, ``explain``, ``tune``, ...): the only code
outside the engine that imports it (DESIGN.md, "The engine"), inside the commands, so building the parser
(``layerzero --help``, ``doctor``) does not import it; ``serve`` adds the server's own flags
(``layerzero.engine.entrypoints.openai.api_server.add_server_args``) only when it parses.

``generate`` exits 1 when a request fails inside a step (the reason on stderr); LayerZero errors exit 2
(``layerzero.cli.main``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["ENGINE_DTYPES", "ENGINE_KWARGS", "add_engine_args", "add_parsers", "engine_kwargs"]

ENGINE_DTYPES = ("float32", "float16", "bfloat16")
"""``--dtype`` of the engine commands: the names of ``layerzero.engine.config.DTYPES`` (what
``LLM(dtype=...)`` accepts; float64 is not one: the engine's kernels and KV pool run in these)."""
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")
"""``--scheduling-policy``: ``layerzero.engine.config.SCHEDULING_POLICIES`` (a test keeps them equal)."""
PREFIX_CACHES = ("radix", "hash")
"""``--prefix-cache``: ``layerzero.engine.config.PREFIX_CACHES``."""
QUANTIZATIONS = ("int8", "int4", "fp8", "fp8_w8a8")
"""``--quantization``: ``layerzero.engine.config.QUANTIZATIONS``."""
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
"""``--kv-cache-dtype``: the keys of ``layerzero.engine.config.KV_CACHE_DTYPES``."""
LOAD_FORMATS = ("auto", "dummy")
"""``--load-format``: ``layerzero.engine.config.LOAD_FORMATS``."""

ENGINE_KWARGS = (
    "model",
    "dtype",
    "device",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory_fraction",
    "enable_prefix_caching",
    "prefix_cache",
    "scheduling_policy",
    "enforce_eager",
    "seed",
    "cpu_kv_cache_bytes",
    "quantization",
    "kv_cache_dtype",
    "async_scheduling",
    "cascade_attention",
    "freeze_gc",
    "warmup",
    "tensor_parallel_size",
    "enable_expert_parallel",
    "data_parallel_size",
    "load_format",
    "speculative_config",
    "logits_processors",
    "idle_poll_s",
)
"""The ``LLM`` / ``AsyncLLM`` keywords :func:`engine_kwargs` returns, each set by the flag ``--<name with
dashes>``: every ``EngineConfig`` field but ``cuda_graph`` (a knob set, not a command-line value)."""


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ``LLM`` option to ``parser`` (defaults: ``LLM``'s; see its docstring for each).

    ``--model DIR`` is required; ``--dtype auto`` is ``dtype=None``; ``--enable-prefix-caching`` /
    ``--no-enable-prefix-caching`` (default on); ``--async-scheduling``, ``--cascade-attention``,
    ``--freeze-gc`` and ``--warmup`` have ``--no-`` forms and default to None (the engine decides by device).
    Values are checked by ``EngineConfig`` when the engine is built (a ``ConfigurationError``: exit 2).
    """
    g = parser.add_argument_group("engine", "LLM(...) options (layerzero.engine.LLM; defaults are LLM's)")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    g.add_argument("--dtype", choices=("auto", *ENGINE_DTYPES), default="auto", help="auto: bf16 on CUDA")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: CUDA when available)")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per sequence")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (8192)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: from memory)")
    g.add_argument(
        "--kv-cache-memory-fraction", type=float, default=0.9, help="of free GPU memory for the KV pool"
    )
    g.add_argument("--cpu-kv-cache-bytes", type=int, default=1 << 30, help="KV pool bytes on the CPU (1 GiB)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--prefix-cache", choices=PREFIX_CACHES, default="radix")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="default: none")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    g.add_argument("--seed", type=int, default=0, help="the engine's random stream")
    for name, what in (
        ("async-scheduling", "on for CUDA"),
        ("cascade-attention", "on for CUDA with prefix caching"),
        ("freeze-gc", "on for CUDA"),
        ("warmup", "dummy steps over the step shapes at start-up (compiles kernels); on for CUDA"),
    ):
        g.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None, help=what)
    idle = "the core polls busy this long after a step, then blocks (2 on CUDA, 0 on CPU)"
    g.add_argument("--idle-poll-s", type=float, default=None, metavar="S", help=idle)
    p = parser.add_argument_group("parallel", "ranks holding the model (docs/parallel.md)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="one process and GPU per rank")
    p.add_argument(
        "--enable-expert-parallel", action="store_true", help="split MoE experts over the TP ranks"
    )
    p.add_argument("--data-parallel-size", type=int, default=1, help="1 (not implemented yet)")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: seeded random weights")
    s = parser.add_argument_group("speculative decoding", "docs/decoding.md, 'Speculative decoding'")
    s.add_argument(
        "--speculative-config", metavar="JSON", help='vLLM\'s keys, e.g. \'{"method": "ngram", ...}\''
    )
    g.add_argument(
        "--logits-processors",
        nargs="+",
        default=(),
        metavar="MODULE:CLASS",
        help="logits-processor plugins (LogitsProcessor subclasses; docs/decoding.md)",
    )


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The keywords of ``LLM(**kw)`` / ``AsyncLLM(**kw)`` from flags added by :func:`add_engine_args`: one per
    name of :data:`ENGINE_KWARGS`, ``--dtype`` as a ``torch.dtype`` (None for ``auto``)."""
    kw = {name: getattr(ns, name) for name in ENGINE_KWARGS}
    if kw["dtype"] == "auto":
        kw["dtype"] = None
    else:
        import torch

        kw["dtype"] = getattr(torch, kw["dtype"])
    return kw


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
    """Run every ``--prompt`` as one batch with the serving engine; one prompt is streamed."""
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.errors import bad_config, bad_input

    prios = ns.priority
    if prios is not None and len(prios) != len(ns.prompt):
        raise bad_input(
            "--priority",
            f"none, or one per --prompt ({len(ns.prompt)})",
            f"{len(prios)} --priority value{'s' if len(prios) != 1 else ''}",
            "Pass --priority once after each --prompt, in the same order.",
        )
    if prios is not None and ns.scheduling_policy != "priority":
        raise bad_config(
            "--priority",
            "--scheduling-policy priority (the policy that reads priorities)",
            f"--scheduling-policy {ns.scheduling_policy}",
            "Add --scheduling-policy priority, or drop --priority.",
        )
    llm = LLM(**engine_kwargs(ns))
    params = SamplingParams(
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        max_tokens=ns.max_tokens,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )
    prompts: list[Any] = list(ns.prompt)
    if ns.chat:
        prompts = [_chat_prompt(llm.tokenizer, p, ns.model) for p in prompts]
    if len(prompts) == 1 and not ns.jsonl:
        return _stream_one(llm, prompts[0], params, prios[0] if prios else 0)
    outs = llm.generate(prompts, params, priority=prios, use_tqdm=False)
    rc = 0
    for i, out in enumerate(outs):
        c = out.outputs[0]
        if ns.jsonl:
            rec = {"index": i, "priority": prios[i] if prios else None, "text": c.text}
            rec |= {"token_ids": list(c.token_ids), "finish_reason": c.finish_reason, "error": out.error}
            print(json.dumps(rec), flush=True)
        else:
            print(c.text, flush=True)
            print(f"[{i}: finish_reason={c.finish_reason}]", file=sys.stderr)
        if out.error is not None:  # failed inside a step (finish_reason "error"): say why, exit non-zero
            print(f"layerzero: error: prompt {i}: {out.error}", file=sys.stderr)
            rc = 1
    return rc


def _stream_one(llm: Any, prompt: Any, params: Any, priority: int) -> int:
    """Stream one completion to stdout (its finish reason to stderr); 1 when it failed inside a step."""
    last = None
    for delta in llm.stream(prompt, params, priority=priority):
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
    """nano-vllm's benchmark through the engine (see layerzero.engine.tools.bench)."""
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
        engine_options={
            "tensor_parallel_size": ns.tensor_parallel_size,
            "enable_expert_parallel": ns.enable_expert_parallel,
            "load_format": ns.load_format,
            "speculative_config": ns.speculative_config,
        },
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


class _ServeParser(argparse.ArgumentParser):
    """``layerzero serve``'s parser: adds the server's flags (``add_server_args`` of
    ``layerzero.engine.entrypoints.openai.api_server``) the first time it parses, so building ``layerzero``'s
    parser imports no server code; without the server (``pip install 'layerzero[serve]'``) it says why and
    exits 2."""

    server_args_added = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        if not self.server_args_added:
            try:
                from layerzero.engine.entrypoints.openai.api_server import add_server_args
            except ImportError as exc:
                self.error(
                    f"the server is unavailable ({type(exc).__name__}: {exc}); install its dependencies: "
                    "pip install 'layerzero[serve]'"
                )
            add_server_args(self)
            self.server_args_added = True
        return super().parse_known_args(args, namespace)


def _cmd_serve(ns: argparse.Namespace) -> int:
    """Run the OpenAI-compatible server until it is stopped (SIGINT / SIGTERM drain it)."""
    from layerzero.engine.entrypoints.openai.api_server import run_server

    return int(run_server(ns, engine_kwargs(ns)))


def add_parsers(sub: Any) -> None:
    """Add ``generate``, ``serve``, ``bench-engine`` and ``bench-serve`` to ``sub`` (the ``add_subparsers``
    action of the ``layerzero`` parser)."""
    g = sub.add_parser(
        "generate",
        help="run prompts through the serving engine as one batch (one prompt: streamed)",
        description="Every --prompt runs in one batch; outputs print in prompt order (one prompt: streamed).",
    )
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument(
        "--priority", action="append", type=int, default=None, help="one per --prompt (lower runs first)"
    )
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="each request's own seed")
    g.add_argument("--stop", nargs="*", default=None, help="stop strings")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--jsonl", action="store_true", help="one JSON object per prompt (text, ids, finish)")
    g.set_defaults(fn=_cmd_generate)
    sv = sub.add_parser("serve", help="the OpenAI-compatible server (layerzero[serve])")
    sv.__class__ = _ServeParser  # its server flags are added when it parses
    add_engine_args(sv)
    sv.set_defaults(fn=_cmd_serve)
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
        "--tensor-parallel-size", type=int, default=1, help="ranks holding the model (docs/parallel.md)"
    )
    be.add_argument(
        "--enable-expert-parallel", action="store_true", help="a MoE model's experts split over the ranks"
    )
    be.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="dummy: seeded random weights, only config.json read (benchmarks/parallel/shapes.py)",
    )
    be.add_argument(
        "--speculative-config", default=None, metavar="JSON", help="speculative decoding (vLLM's keys)"
    )
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
    from layerzero.engine.tools.bench_serve_cli import add_bench_serve

    add_bench_serve(sub)
