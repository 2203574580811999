"""Start ``layerzero serve`` on a free loopback port, run ``layerzero bench-serve --sweep-rates`` against it,
stop it (SIGINT: it drains and exits), and optionally time ``LLM.generate`` offline on the same requests (the
issue's rate-inf target: online output tok/s >= 0.95x offline). See README.md beside this file.

    python benchmarks/serving/serve_and_bench.py --scale cpu --out /tmp/serving-cpu
    python benchmarks/serving/serve_and_bench.py --scale full --out benchmarks/results/serving/h200 --offline

Scales: ``cpu`` (the 2-layer CPU checkpoint of ``layerzero bench-engine``, 32 short requests) and ``full``
(the Qwen3-0.6B-shaped checkpoint, bf16 on CUDA, ShareGPT-like lengths). ``--model DIR`` serves another
checkpoint; flags after ``--`` go to ``layerzero serve`` (engine and server flags).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SCALES = {
    # bench-serve flags per scale: prompt / output lengths (lognormal means, clips), requests per rate
    "cpu": {"num_prompts": 32, "input": (32.0, 128), "output": (16.0, 64), "serve": ["--device", "cpu"]},
    "full": {"num_prompts": 200, "input": (161.31, 1024), "output": (337.99, 1024), "serve": []},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"layerzero serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"layerzero serve not healthy after {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen, group: bool = False) -> int:
    """SIGINT (the server drains; ``group``: to the whole process group, the server under a profiler too),
    then SIGKILL after 60 s; the exit code."""
    if proc.poll() is None:
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _offline(serve_args: list[str], bench_args: list[str], out: Path) -> dict:
    """``LLM.generate`` with the server's engine flags on the requests bench-serve sent (same seed and
    lengths), timed after a warm-up run."""
    from layerzero.cli import build_parser
    from layerzero.cli_engine import add_engine_args, engine_kwargs
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.tools import bench_serve as bs

    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    llm = LLM(**engine_kwargs(engine.parse_known_args(serve_args)[0]))  # the server flags are left out

    ns = build_parser().parse_args(["bench-serve", *bench_args])
    cfg = bs.BenchServeConfig(
        num_prompts=ns.num_prompts,
        seed=ns.seed,
        input_len=bs.LengthDistribution(ns.input_len_mean, ns.len_sigma, ns.min_len, ns.max_input_len),
        output_len=bs.LengthDistribution(ns.output_len_mean, ns.len_sigma, ns.min_len, ns.max_output_len),
    )
    reqs = bs.make_requests(cfg)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    prompts = [p for p, _ in reqs]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (first-use compiles)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"requests": len(reqs), "output_tokens": n_out, "seconds": dt, "output_throughput": n_out / dt}
    (out / "offline.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=tuple(SCALES), default="cpu")
    p.add_argument("--model", default=None, help="checkpoint (default: bench-engine's of this scale)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rates", default="1,4,16,64,inf")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--client-processes", type=int, default=1, help="bench-serve's: send from this many processes"
    )
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS")
    p.add_argument("--offline", action="store_true", help="also time LLM.generate on the same requests")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--server-prefix",
        default="",
        help="a command the server runs under, e.g. 'py-spy record --subprocesses -f speedscope -o P --' "
        "(its own process group; SIGINT goes to the group at the end)",
    )
    ns = p.parse_args(argv)
    sc = SCALES[ns.scale]
    model = ns.model
    if model is None:
        import torch

        from layerzero.engine.tools.bench import default_checkpoint

        model = str(default_checkpoint(ns.scale, torch.bfloat16 if ns.scale == "full" else torch.float32))
    ns.out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "layerzero", "serve", "--model", model, "--port", str(port)]
    serve += sc["serve"] + extra
    bench = ["--num-prompts", str(ns.num_prompts or sc["num_prompts"]), "--min-len", "4"]
    bench += ["--input-len-mean", str(sc["input"][0]), "--max-input-len", str(sc["input"][1])]
    bench += ["--output-len-mean", str(sc["output"][0]), "--max-output-len", str(sc["output"][1])]
    if ns.max_concurrency:
        bench += ["--max-concurrency", str(ns.max_concurrency)]
    if ns.goodput:
        bench += ["--goodput", *ns.goodput]
    if ns.client_processes > 1:
        bench += ["--client-processes", str(ns.client_processes)]
    t0 = time.monotonic()
    with open(ns.out / "server.log", "w") as log:
        prefix = shlex.split(ns.server_prefix)
        proc = subprocess.Popen(
            prefix + serve,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ},
            start_new_session=bool(prefix),
        )
        try:
            _wait_healthy(url, proc, ns.startup_timeout)
            startup_s = time.monotonic() - t0
            cmd = [sys.executable, "-m", "layerzero", "bench-serve", "--base-url", url, *bench]
            cmd += ["--sweep-rates", ns.rates, "--result-dir", str(ns.out)]
            rc = subprocess.run(cmd).returncode
        finally:
            server_rc = _stop(proc, group=bool(prefix))
    summary = {"serve_command": serve[1:], "startup_seconds": startup_s, "server_exit_code": server_rc}
    if rc == 0 and ns.offline:
        summary["offline"] = off = _offline(serve[4:], bench, ns.out)
        runs = json.loads((ns.out / "sweep.json").read_text())["runs"]
        inf = [r for r in runs if r["request_rate"] in ("inf", math.inf)]
        if inf:
            summary["rate_inf_vs_offline"] = inf[0]["output_throughput"] / off["output_throughput"]
    (ns.out / "serve_and_bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return int(rc or server_rc != 0)


if __name__ == "__main__":
    sys.exit(main())
