"""The ``layerzero bench-serve`` subcommand: its flags and what runs them (:mod:`.bench_serve`)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from ..errors import bad_input

__all__ = ["add_bench_serve"]


def _cmd_bench_serve(ns: argparse.Namespace) -> int:
    """vLLM's ``bench serve`` against ``--base-url`` (layerzero.engine.tools.bench_serve)."""
    from . import bench_serve as bs

    lo, _, hi = ns.token_id_range.partition(":")
    if not (lo.isdigit() and hi.isdigit()):
        raise bad_input("--token-id-range", "LO:HI (ints)", repr(ns.token_id_range))
    cfg = bs.BenchServeConfig(
        base_url=ns.base_url.rstrip("/"),
        model=ns.model,
        endpoint=ns.endpoint,
        num_prompts=ns.num_prompts,
        request_rate=math.inf if ns.request_rate is None else ns.request_rate,
        max_concurrency=ns.max_concurrency,
        seed=ns.seed,
        input_len=bs.LengthDistribution(ns.input_len_mean, ns.len_sigma, ns.min_len, ns.max_input_len),
        output_len=bs.LengthDistribution(ns.output_len_mean, ns.len_sigma, ns.min_len, ns.max_output_len),
        token_ids=(int(lo), int(hi)),
        goodput_ms=bs.parse_goodput(ns.goodput),
        ignore_eos=ns.ignore_eos,
        api_key=ns.api_key or os.environ.get("LAYERZERO_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        request_timeout_s=ns.request_timeout,
        client_processes=ns.client_processes,
    )
    if ns.sweep_rates is None:
        bs.run(cfg, ns.result_json)
        return 0
    for flag, value in (("--request-rate", ns.request_rate), ("--result-json", ns.result_json)):
        if value is not None:
            raise bad_input(
                flag, "not with --sweep-rates (each rate writes <--result-dir>/rate_<r>.json)", value
            )
    bs.sweep(cfg, bs.parse_rates(ns.sweep_rates), ns.result_dir)
    return 0


def add_bench_serve(sub: Any) -> None:
    """Add ``bench-serve`` to ``sub`` (the ``add_subparsers`` action of the ``layerzero`` parser)."""
    bs = sub.add_parser(
        "bench-serve",
        help="vLLM's bench serve (TTFT, TPOT, ITL, throughput, goodput) against an OpenAI-compatible server",
        description="Poisson arrivals of streamed /v1/completions requests with a synthetic ShareGPT-like "
        "length distribution (lognormal, ShareGPT's mean lengths, clipped; random token-id prompts): see "
        "layerzero.engine.tools.bench_serve and benchmarks/serving/README.md.",
    )
    bs.add_argument("--base-url", default="http://127.0.0.1:8000")
    bs.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    bs.add_argument("--endpoint", default="/v1/completions")
    bs.add_argument("--num-prompts", type=int, default=200)
    bs.add_argument("--request-rate", type=float, default=None, help="req/s, Poisson (default: inf)")
    bs.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    bs.add_argument("--seed", type=int, default=0, help="lengths, prompts and arrivals")
    bs.add_argument("--input-len-mean", type=float, default=161.31, help="prompt tokens (ShareGPT's)")
    bs.add_argument("--output-len-mean", type=float, default=337.99, help="output tokens (ShareGPT's)")
    bs.add_argument("--len-sigma", type=float, default=1.0, help="lognormal sigma of both lengths")
    bs.add_argument("--min-len", type=int, default=4, help="lengths clipped below (vLLM's filter)")
    bs.add_argument("--max-input-len", type=int, default=1024, help="prompt lengths clipped above")
    bs.add_argument("--max-output-len", type=int, default=1024, help="output lengths clipped above")
    bs.add_argument("--token-id-range", default="3:500", metavar="LO:HI", help="prompt ids in [LO, HI)")
    bs.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs: ttft tpot e2el")
    bs.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    bs.add_argument("--api-key", default=None, help="default: $LAYERZERO_API_KEY or $OPENAI_API_KEY")
    bs.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    bs.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="send from this many processes (one tops out at some 30-40k streamed tokens/s)",
    )
    bs.add_argument("--result-json", type=Path, default=None, help="write the result here")
    bs.add_argument("--sweep-rates", default=None, metavar="R,R,...", help="e.g. 1,4,16,64,inf")
    bs.add_argument(
        "--result-dir", type=Path, default=Path("bench_serve_results"), help="--sweep-rates' output"
    )
    bs.set_defaults(fn=_cmd_bench_serve)
