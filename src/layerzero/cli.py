"""The ``layerzero`` command line: ``doctor``, ``explain``, ``list-kernels``, ``demo``.

``layerzero explain attention --batch 2 --heads 32 --kv-heads 8 --seq 1024 --head-dim 128 --dtype bfloat16
--causal`` builds tensors of that shape (on ``--device``, default cpu) and prints the selection table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

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
            "attn_mask": mask, "is_causal": ns.causal, "dropout_p": ns.dropout, "layout": ns.layout}
    if ns.op in ("rms_norm", "layer_norm"):
        return (t(ns.batch, ns.seq, ns.hidden), t(ns.hidden)), {}
    if ns.op == "rope":
        hkv = ns.kv_heads or ns.heads
        return (t(ns.batch, ns.heads, ns.seq, ns.head_dim), t(ns.batch, hkv, ns.seq, ns.head_dim),
                t(ns.batch, ns.seq, ns.head_dim), t(ns.batch, ns.seq, ns.head_dim)), {}
    if ns.op == "sample_topk":
        return (t(ns.batch, ns.vocab), ns.top_k), {}
    return (t(ns.batch, ns.vocab), ns.top_p), {}


def _cmd_explain(ns: argparse.Namespace) -> int:
    import layerzero as lz

    args, kwargs = _explain_args(ns)
    report = lz.explain(ns.op, *args, **kwargs)
    if ns.json:
        print(report.to_json())
        return 0
    try:
        from rich.console import Console
    except ImportError:
        print(report)
        return 0
    console = Console(width=max(140, Console().width))
    ctx = {k: v for k, v in report.context.fields().items() if v not in (None, False)}
    console.print(f"[bold]{ns.op}[/bold] on {report.context.device}")
    console.print("context: " + ", ".join(f"{k}={v}" for k, v in ctx.items()))
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(report)  # uses SelectionReport.__rich__
    return 0


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from layerzero.doctor import run_doctor

    report = run_doctor(print_report=not ns.json)
    if ns.json:
        print(report.to_json())
    return 0


def _cmd_list(ns: argparse.Namespace) -> int:
    import layerzero as lz
    from layerzero.doctor import Table, print_tables

    kernels = lz.list_kernels(ns.op)
    if ns.json:
        print(json.dumps(kernels, indent=2, default=str))
        return 0
    rows = tuple((k["kernel_id"], k["op"], "yes" if k["available"] else "NO", str(k["priority"]),
                  ",".join(k["device_types"]), ",".join(k["dtypes"]), k["description"]) for k in kernels)
    print_tables([Table("Registered kernels", ("kernel", "op", "available", "priority", "devices", "dtypes",
                                               "description"), rows)])
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    from layerzero.demo import main as demo_main

    return int(demo_main(ns.rest))


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``layerzero`` command."""
    p = argparse.ArgumentParser(prog="layerzero", description="LayerZero kernel selection: inspect and explain.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="device, backends, kernels, config, policy, health, PerfDB")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=_cmd_doctor)
    e = sub.add_parser("explain", help="why a kernel is chosen for a shape")
    e.add_argument("op", choices=("attention", "rms_norm", "layer_norm", "rope", "sample_topk", "sample_topp"))
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
    lk = sub.add_parser("list-kernels", help="every registered kernel and its constraints")
    lk.add_argument("--op", default=None)
    lk.add_argument("--json", action="store_true")
    lk.set_defaults(fn=_cmd_list)
    dm = sub.add_parser("demo", help="run tiny Transformers models stock vs LayerZero and compare")
    dm.add_argument("rest", nargs=argparse.REMAINDER)
    dm.set_defaults(fn=_cmd_demo)
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
