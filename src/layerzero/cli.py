"""The ``layerzero`` command line: ``doctor``, ``explain``, ``list-kernels``, ``capabilities``, ``tune``,
``demo``, ``solve``, ``dry-run``, ``readiness`` (the last three: ``layerzero.planning.commands``).

``layerzero explain attention --batch 2 --heads 32 --kv-heads 8 --seq 1024 --head-dim 128 --dtype bfloat16
--causal`` builds tensors of that shape (on ``--device``, default cpu) and prints the selection table. The
engine's commands: ``generate`` (prompts through the engine as one batch), ``serve`` (the OpenAI-compatible
server), ``bench-engine`` and ``bench-serve``, in ``layerzero.cli_engine``.

Every LayerZero error (``ConfigurationError``: a bad option or checkpoint; ``InvalidInputError``: a bad prompt
or sampling parameter) prints ``layerzero: error: <message>`` to stderr and exits 2, as argparse does for bad
arguments; no traceback. ``generate`` exits 1 when the request fails inside a step (the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from layerzero.cli_engine import ENGINE_DTYPES  # noqa: F401 - re-exported
from layerzero.cli_engine import add_parsers as add_engine_parsers
from layerzero.core.errors import LayerZeroError

DTYPES = ("float32", "float16", "bfloat16", "float64")


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
    add_engine_parsers(sub)  # generate, serve, bench-engine, bench-serve (cli_engine.py)
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
