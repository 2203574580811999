"""What limits data parallelism behind one server (issue 38's DP target): the same 1,000 streamed requests at
rate inf through four layouts, one after another on one machine:

- ``dp1``: one ``layerzero serve`` on GPU 0, one ``bench-serve`` client (the baseline);
- ``dp2``: one server with ``--data-parallel-size 2``, one client (what the target measures);
- ``dp2_2clients``: the same server, two clients of half the requests each (is the client the limit?);
- ``2x_dp1``: two independent servers (GPU 0, GPU 1), a client of half the requests each (one API process per
  replica: the ceiling of several API processes in front of two replicas);
- ``dp1_api2``: one replica behind two API-server processes (``--api-server-count 2``; ``dp2`` gets two by
  default, as in vLLM).

Each server gets an untimed warm-up run first (``--warmup`` requests), then one timed run per entry of
``--num-prompts``; each client is one ``bench-serve`` of ``--client-processes`` processes.
Each API-server process's CPU use during the run (``/proc/PID/stat``, user +
system, as a fraction of one core over the slowest client's run) is recorded next to the throughput: a front
end at ~1.0 is saturated. Throughput is the clients' output tokens over the slowest client's own duration
(their start-up, importing layerzero, left out; clients start together).

    python benchmarks/parallel/dp_ceiling.py --out /tmp/dp_ceiling [--layouts dp1,dp2,dp2_2clients,2x_dp1]
    python benchmarks/parallel/dp_ceiling.py --out /tmp/dp --layouts dp1,dp2 --client-processes 4 \
        --num-prompts 1000,3000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from serve_and_bench import _free_port, _stop, _wait_healthy  # noqa: E402

LAYOUTS = ("dp1", "dp2", "dp2_2clients", "2x_dp1", "dp1_api2")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _api_pids(pid: int) -> list[int]:
    """The API-server processes of the server ``pid``: its children that lead their own process group
    (``--api-server-count`` > 1), else ``pid`` itself."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        kids += [int(k) for k in (task / "children").read_text().split()]
    leaders = [k for k in kids if os.getpgid(k) == k]
    return leaders or [pid]


def _serve(model: str, flags: list[str], gpus: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "layerzero", "serve", "--model", model, "--port", str(port), *flags]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc, 600)
    return proc, url


def _clients(
    urls: list[str], n: int, out: Path, name: str, servers: list[subprocess.Popen], procs_each: int = 1
) -> dict:
    """``n`` requests split evenly over ``urls`` (one bench-serve process each, started together); the
    combined throughput over the wall time of the slowest, and each server's API-process CPU use."""
    out.mkdir(parents=True, exist_ok=True)
    per = n // len(urls)
    api = [pid for p in servers for pid in _api_pids(p.pid)]
    cpu0 = [_cpu_s(pid) for pid in api]
    t0 = time.perf_counter()
    procs = []
    for i, url in enumerate(urls):
        cmd = [sys.executable, "-m", "layerzero", "bench-serve", "--base-url", url, "--num-prompts", str(per)]
        cmd += ["--seed", str(i), "--result-json", str(out / f"{name}_client{i}.json")]
        cmd += ["--client-processes", str(procs_each)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    for p in procs:
        p.wait()
    wall = time.perf_counter() - t0
    res = [json.loads((out / f"{name}_client{i}.json").read_text()) for i in range(len(urls))]
    span = max(r["duration"] for r in res)  # the clients' own clocks: their start-up (imports) left out
    cpu = [(_cpu_s(pid) - c) / span for pid, c in zip(api, cpu0, strict=True)]
    tokens = sum(r["total_output_tokens"] for r in res)
    return {
        "layout": name,
        "client_processes_each": procs_each,
        "requests": per * len(urls),
        "failed": sum(r["failed"] for r in res),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "span_s": round(span, 3),
        "output_tok_s": round(tokens / span, 1),
        "client_durations_s": [round(r["duration"], 3) for r in res],
        "client_output_tok_s": [round(r["output_throughput"], 1) for r in res],
        "median_itl_ms": [round(r["median_itl_ms"], 2) for r in res],
        "median_tpot_ms": [round(r["median_tpot_ms"], 2) for r in res],
        "api_process_cpu": [round(c, 3) for c in cpu],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="checkpoint (default: bench-engine's full-scale one)")
    p.add_argument("--num-prompts", default="1000", help="comma-separated: one timed run of each, in order")
    p.add_argument("--client-processes", type=int, default=1, help="processes of each bench-serve client")
    p.add_argument("--warmup", type=int, default=100, help="untimed requests per server first")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--serve-flags", default="", help="extra flags for every server")
    ns = p.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ns.model
    if model is None:
        import torch

        from layerzero.engine.tools.bench import default_checkpoint

        model = str(default_checkpoint("full", torch.bfloat16))
    extra = ns.serve_flags.split()
    layouts = ns.layouts.split(",")
    results = []

    def run(servers_spec: list[tuple[list[str], str]], runs: list[tuple[str, int]]) -> None:
        servers = []
        try:
            for i, (flags, gpus) in enumerate(servers_spec):
                servers.append(_serve(model, flags + extra, gpus, out / f"{runs[0][0]}_server{i}.log"))
            procs, urls = [s for s, _ in servers], [u for _, u in servers]
            if ns.warmup:
                _clients(urls, ns.warmup * len(urls), out / "warmup", "warmup", procs, ns.client_processes)
            for name, n_clients in runs:
                targets = urls if len(urls) == n_clients else urls * n_clients
                for n in (int(x) for x in ns.num_prompts.split(",")):
                    r = _clients(targets, n, out, f"{name}_n{n}", procs, ns.client_processes)
                    r["layout"] = name
                    print(json.dumps(r), flush=True)
                    results.append(r)
        finally:
            for s, _ in servers:
                _stop(s)  # SIGINT: the server drains and exits

    if "dp1" in layouts:
        run([([], "0")], [("dp1", 1)])
    dp2_runs = [(n, c) for n, c in (("dp2", 1), ("dp2_2clients", 2)) if n in layouts]
    if dp2_runs:
        run([(["--data-parallel-size", "2"], "0,1")], dp2_runs)
    if "2x_dp1" in layouts:
        run([([], "0"), ([], "1")], [("2x_dp1", 2)])
    if "dp1_api2" in layouts:
        run([(["--api-server-count", "2"], "0")], [("dp1_api2", 1)])
    base = {r["requests"]: r["output_tok_s"] for r in results if r["layout"] == "dp1"}
    lines = [
        "| layout | requests | output tok/s | vs dp1 | span s | API-process CPU | median ITL ms | failed |"
    ]
    lines.append("| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for r in results:
        b = base.get(r["requests"])
        ratio = f"{r['output_tok_s'] / b:.2f}x" if b else "-"
        lines.append(
            f"| {r['layout']} | {r['requests']} | {r['output_tok_s']:,.0f} | {ratio} | {r['span_s']} "
            f"| {r['api_process_cpu']} "
            f"| {r['median_itl_ms']} | {r['failed']} |"
        )
    (out / "dp_ceiling.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "dp_ceiling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
