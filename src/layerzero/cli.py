"""The ``layerzero`` command line: ``doctor``, ``explain``, ``list-kernels``, ``capabilities``, ``tune``,
``demo``, ``solve``, ``dry-run``, ``readiness`` (the last three: ``layerzero.planning.commands``).

``layerzero explain attention --batch 2 --heads 32 --kv-heads 8 --seq 1024 --head-dim 128 --dtype bfloat16
--causal`` builds tensors of that shape (on ``--device``, default cpu) and prints the selection table. The
engine's commands: ``generate`` (stream one completion from a checkpoint) and ``bench-engine``.

Every LayerZero error (``ConfigurationError``: a bad option or checkpoint; ``InvalidInputError``: a bad prompt
or sampling parameter) prints ``layerzero: error: <message>`` to stderr and exits 2, as argparse does for bad
arguments; no traceback. ``generate`` exits 1 when the request fails inside a step (the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layerzero.core.errors import LayerZeroError

DTYPES = ("float32", "float16", "bfloat16", "float64")
ENGINE_DTYPES = ("float32", "float16", "bfloat16")
"""``--dtype`` of the engine commands: the names of ``layerzero.engine.config.DTYPES`` (what
``LLM(dtype=...)`` accepts; float64 is not one: the engine's kernels and KV pool run in these)."""


def _explain_args(ns: argparse.Namespace) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    dtype = getattr(torch, ns.dtype)
    dev = torch.device(ns.device)
    g = torch.Generator(device="cpu").manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)

    if ns.op == "attention":
        b, hq, hkv, sq, d = ns.batch, ns.heads, ns.kv_heads or ns.heads, ns.seq, ns.head_dim
        sk = ns.kv_seq or sq
        bshd = ns.layout == "BSHD"
        shape_q = (b, sq, hq, d) if bshd else (b, hq, sq, d)
        shape_k = (b, sk, hkv, d) if bshd else (b, hkv, sk, d)
        mask = None
        if ns.mask == "bool":
            mask = torch.ones(b, 1, sq, sk, dtype=torch.bool, device=dev)
        elif ns.mask == "float":
            mask = torch.zeros(b, 1, sq, sk, dtype=dtype, device=dev)
        return (t(*shape_q), t(*shape_k), t(*shape_k)), {
            "attn_mask": mask,
            "is_causal": ns.causal,
            "dropout_p": ns.dropout,
            "layout": ns.layout,
        }
    if ns.op in ("rms_norm", "layer_norm"):
        return (t(ns.batch, ns.seq, ns.hidden), t(ns.hidden)), {}
    if ns.op == "swiglu":  # --hidden is the intermediate size here
        return (t(ns.batch, ns.seq, ns.hidden), t(ns.batch, ns.seq, ns.hidden)), {}
    if ns.op == "rope":
        hkv = ns.kv_heads or ns.heads
        return (
            t(ns.batch, ns.heads, ns.seq, ns.head_dim),
            t(ns.batch, hkv, ns.seq, ns.head_dim),
            t(ns.batch, ns.seq, ns.head_dim),
            t(ns.batch, ns.seq, ns.head_dim),
        ), {}
    if ns.op == "sample_topk":
        return (t(ns.batch, ns.vocab), ns.top_k), {}
    return (t(ns.batch, ns.vocab), ns.top_p), {}


def _console(report: Any, as_json: bool) -> Any:
    """Print ``report`` as JSON or plain text and return None, or return a wide rich Console to print it with
    (when rich is installed and JSON was not asked for)."""
    if as_json:
        print(report.to_json())
        return None
    try:
        from rich.console import Console
    except ImportError:
        print(report)
        return None
    return Console(width=max(140, Console().width))


def _cmd_explain(ns: argparse.Namespace) -> int:
    import layerzero as lz

    args, kwargs = _explain_args(ns)
    report = lz.explain(ns.op, *args, **kwargs)
    console = _console(report, ns.json)
    if console is None:
        return 0
    ctx = {k: v for k, v in report.context.fields().items() if v not in (None, False)}
    console.print(f"[bold]{ns.op}[/bold] on {report.context.device}")
    console.print("context: " + ", ".join(f"{k}={v}" for k, v in ctx.items()))
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(report)  # uses SelectionReport.__rich__
    return 0


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from layerzero.diagnostics import run_doctor

    report = run_doctor(print_report=not ns.json)
    if ns.json:
        print(report.to_json())
    return 0


def _cmd_quarantine(ns: argparse.Namespace) -> int:
    from layerzero.core.runtime import RUNTIME

    RUNTIME.ensure_ready()
    store = RUNTIME.quarantine()
    if store is None:
        print("quarantine: unavailable (the PerfDB is off or unusable)", file=sys.stderr)
        return 1
    if ns.clear is not None:
        n = store.clear(ns.clear or None)
        RUNTIME.cache.invalidate()
        print(f"lifted {n} quarantine entr{'y' if n == 1 else 'ies'}")
        return 0
    entries = store.entries()
    for e in entries:
        print(e)
    if not entries:
        print("no quarantined backends")
    return 0


def _cmd_list(ns: argparse.Namespace) -> int:
    import layerzero as lz
    from layerzero.diagnostics import Table, print_tables

    kernels = lz.list_kernels(ns.op)
    if ns.json:
        print(json.dumps(kernels, indent=2, default=str))
        return 0
    rows = tuple(
        (
            k["kernel_id"],
            k["op"],
            "yes" if k["available"] else "NO",
            str(k["priority"]),
            ",".join(k["device_types"]),
            ",".join(k["dtypes"]),
            k["description"],
        )
        for k in kernels
    )
    print_tables(
        [
            Table(
                "Registered kernels",
                ("kernel", "op", "available", "priority", "devices", "dtypes", "description"),
                rows,
            )
        ]
    )
    return 0


def _cmd_capabilities(ns: argparse.Namespace) -> int:
    import yaml

    from layerzero.core.capabilities import describe_backend
    from layerzero.core.runtime import RUNTIME

    RUNTIME.ensure_ready()
    backends = [ns.backend] if ns.backend else list(RUNTIME.registry.backends)
    for backend in backends:
        text = (
            f"# Capability descriptor of backend {backend!r}, generated by `layerzero capabilities "
            "--write`.\n# Copy a kernel's entry into an override file to change a constraint "
            "(lz.load_capabilities).\n"
            + yaml.safe_dump(describe_backend(RUNTIME.registry, backend), sort_keys=True)
        )
        if ns.write:
            with open(f"{ns.write}/{backend}.yaml", "w", encoding="utf-8") as f:
                f.write(text)
        else:
            print(text)
    return 0


_TUNE_PARAMS = {
    "attention": ("heads", "kv_heads", "kv_seq", "head_dim", "causal", "layout"),
    "rms_norm": ("hidden",),
    "layer_norm": ("hidden",),
    "swiglu": ("hidden",),
    "rope": ("heads", "kv_heads", "head_dim"),
    "sample_topk": ("vocab", "top_k"),
    "sample_topp": ("vocab", "top_p"),
    "sample_greedy": ("vocab",),
}


def _tune_cases(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """One shape dict (for ``layerzero.tuning.make_inputs``) per (--batch, --seq) combination."""
    fixed = {name: getattr(ns, name) for name in _TUNE_PARAMS[ns.op]}
    common = {"dtype": ns.dtype, "device": ns.device}
    out = []
    for b in ns.batch:
        for s in ns.seq:
            shape = (
                {"batch": b, **fixed, **common}
                if ns.op.startswith("sample_")
                else {"batch": b, "seq": s, **fixed, **common}
            )
            if shape in out:
                continue
            out.append(shape)
    return out


def _cmd_tune(ns: argparse.Namespace) -> int:
    from layerzero.tuning import tune

    report = tune(
        ns.op,
        _tune_cases(ns),
        kernels=ns.kernels,
        warmup=ns.warmup,
        iters=ns.iters,
        repeats=ns.repeats,
        max_time_s=ns.max_time,
        progress=not ns.no_progress and not ns.json,
    )
    console = _console(report, ns.json)
    if console is not None:
        console.print(report)  # uses TuneReport.__rich__
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    from layerzero.demo import main as demo_main

    return int(demo_main(ns.rest))


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

    from layerzero.engine.bench import run
    from layerzero.engine.config import resolve_device

    resolve_device(ns.device)  # a bad --device is a ConfigurationError before any checkpoint is built
    scale = ns.scale or ("full" if torch.cuda.is_available() and ns.device != "cpu" else "cpu")
    if ns.workload == "prefix":
        from layerzero.engine.bench_prefix import run_prefix

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


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``layerzero`` command."""
    p = argparse.ArgumentParser(
        prog="layerzero", description="LayerZero kernel selection: inspect and explain."
    )
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="device, backends, kernels, config, policy, health, PerfDB")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=_cmd_doctor)
    e = sub.add_parser("explain", help="why a kernel is chosen for a shape")
    e.add_argument(
        "op", choices=("attention", "rms_norm", "layer_norm", "rope", "swiglu", "sample_topk", "sample_topp")
    )
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--heads", type=int, default=8)
    e.add_argument("--kv-heads", type=int, default=None)
    e.add_argument("--seq", type=int, default=128, help="query length in tokens")
    e.add_argument("--kv-seq", type=int, default=None, help="key/value length in tokens (default: --seq)")
    e.add_argument("--head-dim", type=int, default=64)
    e.add_argument("--hidden", type=int, default=4096)
    e.add_argument("--vocab", type=int, default=32000)
    e.add_argument("--top-k", type=int, default=50)
    e.add_argument("--top-p", type=float, default=0.9)
    e.add_argument("--dtype", choices=DTYPES, default="float32")
    e.add_argument("--device", default="cpu")
    e.add_argument("--layout", choices=("BHSD", "BSHD"), default="BHSD")
    e.add_argument("--mask", choices=("none", "bool", "float"), default="none")
    e.add_argument("--causal", action="store_true")
    e.add_argument("--dropout", type=float, default=0.0)
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=_cmd_explain)
    qu = sub.add_parser(
        "quarantine", help="backends quarantined by failed canaries (lz.configure(canaries=True))"
    )
    qu.add_argument(
        "--clear",
        nargs="?",
        const="",
        default=None,
        metavar="BACKEND",
        help="lift every entry, or only BACKEND's",
    )
    qu.set_defaults(fn=_cmd_quarantine)
    lk = sub.add_parser("list-kernels", help="every registered kernel and its constraints")
    lk.add_argument("--op", default=None)
    lk.add_argument("--json", action="store_true")
    lk.set_defaults(fn=_cmd_list)
    cp = sub.add_parser("capabilities", help="kernel constraints as versioned YAML descriptors")
    cp.add_argument("--backend", default=None)
    cp.add_argument(
        "--write", default=None, metavar="DIR", help="write <DIR>/<backend>.yaml instead of printing"
    )
    cp.set_defaults(fn=_cmd_capabilities)
    tu = sub.add_parser("tune", help="check and time every eligible kernel for shapes; write the PerfDB")
    tu.add_argument("op", choices=tuple(_TUNE_PARAMS))
    tu.add_argument("--batch", type=int, nargs="+", default=[1], help="one or more batch sizes")
    tu.add_argument("--seq", type=int, nargs="+", default=[128], help="one or more query lengths (tokens)")
    tu.add_argument("--kv-seq", type=int, default=None, help="key/value length in tokens (default: --seq)")
    tu.add_argument("--heads", type=int, default=8)
    tu.add_argument("--kv-heads", type=int, default=None)
    tu.add_argument("--head-dim", type=int, default=64)
    tu.add_argument("--hidden", type=int, default=4096)
    tu.add_argument("--vocab", type=int, default=32000)
    tu.add_argument("--top-k", type=int, default=50)
    tu.add_argument("--top-p", type=float, default=0.9)
    tu.add_argument("--dtype", choices=DTYPES, default="float32")
    tu.add_argument("--device", default="cpu")
    tu.add_argument("--layout", choices=("BHSD", "BSHD"), default="BHSD")
    tu.add_argument("--causal", action="store_true")
    tu.add_argument("--kernels", nargs="+", default=None, help="kernel ids, backend ids or glob patterns")
    tu.add_argument("--warmup", type=int, default=3, help="untimed calls per kernel and case")
    tu.add_argument("--iters", type=int, default=5, help="calls per sample")
    tu.add_argument("--repeats", type=int, default=20, help="samples per kernel and case")
    tu.add_argument("--max-time", type=float, default=2.0, help="seconds of sampling per kernel and case")
    tu.add_argument("--no-progress", action="store_true")
    tu.add_argument("--json", action="store_true")
    tu.set_defaults(fn=_cmd_tune)
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
    dm = sub.add_parser("demo", help="run tiny Transformers models stock vs LayerZero and compare")
    dm.add_argument("rest", nargs=argparse.REMAINDER)
    dm.set_defaults(fn=_cmd_demo)
    from layerzero.planning.commands import add_parsers

    add_parsers(sub)  # solve, dry-run, readiness (docs/planning.md)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``layerzero`` console script and ``python -m layerzero``; returns the exit code."""
    ns = build_parser().parse_args(argv)
    try:
        return ns.fn(ns)
    except LayerZeroError as exc:
        print(f"layerzero: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
