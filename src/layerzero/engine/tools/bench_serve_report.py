"""``layerzero bench-serve``'s numbers: the per-request timeline (:class:`RequestResult`), the summary vLLM's
``bench serve`` prints (:func:`summarize`), the machine the client ran on (:func:`machine_info`), the text
table (:func:`format_summary`) and the sweep's plot of TTFT and TPOT against the request rate
(:func:`plot_sweep`).

Definitions (vLLM's ``benchmarks/serve.py``, ``calculate_metrics``), over the requests that succeeded:

- TTFT: from sending the request to the first streamed chunk that carries ``choices``.
- ITL: the gaps between successive such chunks (every gap of every request, pooled).
- TPOT: per request, ``(e2el - ttft) / (output_tokens - 1)``; requests of one output token have none (they
  count as 0 against a TPOT SLO, as in vLLM).
- E2EL: from sending the request to the end of its stream.
- throughputs: completed requests, output tokens and prompt + output tokens over the benchmark's duration
  (first request sent to last stream ended); goodput: the requests within every SLO of ``--goodput`` over the
  same duration.
- statistics: mean, median (p50), std, p90 and p99 (numpy's linear-interpolated percentiles), in ms.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "GOODPUT_METRICS",
    "RequestResult",
    "format_summary",
    "machine_info",
    "plot_sweep",
    "summarize",
]

log = logging.getLogger("layerzero.engine.bench_serve")

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
"""The SLO names ``--goodput`` takes (``ttft:MS tpot:MS e2el:MS``; vLLM's)."""
STATS = ("mean", "median", "std", "p90", "p99")


@dataclass(slots=True)
class RequestResult:
    """One request's timeline (seconds from its own send time) and outcome.

    ``output_len``: the server's ``usage.completion_tokens`` when it sent usage, else the number of chunks
    with ``choices``. ``error``: the failure's reason (what failures are grouped by), ``detail`` its message.
    """

    prompt_len: int
    max_tokens: int
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    detail: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, seconds (None for fewer than two tokens)."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def _stats(name: str, seconds: Sequence[float]) -> dict[str, float]:
    """``{mean_<name>_ms, median_<name>_ms, std_..., p90_..., p99_...}`` of ``seconds`` (0.0 when empty)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    if ms.size == 0:
        return {f"{s}_{name}_ms": 0.0 for s in STATS}
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.percentile(ms, 50)),
        f"std_{name}_ms": float(ms.std()),
        f"p90_{name}_ms": float(np.percentile(ms, 90)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def summarize(
    results: Sequence[RequestResult], duration: float, goodput_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """The benchmark's summary (vLLM's field names, see the module docstring) of ``results`` that ran for
    ``duration`` seconds; ``goodput_ms``: SLOs in ms keyed by :data:`GOODPUT_METRICS` (None: no goodput).

    Failed requests count in ``failed`` and ``failures`` (reason -> count; ``failure_examples``: the first
    message of each reason) and in no latency statistic.
    """
    ok = [r for r in results if r.success]
    bad = [r for r in results if not r.success]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(bad),
        "failures": dict(Counter(r.error for r in bad)),
        "failure_examples": {r.error: r.detail for r in reversed(bad)},
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": n_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (n_in + n_out) / duration if duration > 0 else 0.0,
    }
    if goodput_ms:
        good = 0
        for r in ok:
            got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
            good += all(got[k] * 1000.0 <= slo for k, slo in goodput_ms.items())
        out["goodput_slo_ms"] = dict(goodput_ms)
        out["request_goodput"] = good / duration if duration > 0 else 0.0
    out.update(_stats("ttft", [r.ttft for r in ok]))
    out.update(_stats("tpot", tpots))
    out.update(_stats("itl", [g for r in ok for g in r.itl]))
    out.update(_stats("e2el", [r.latency for r in ok]))
    return out


def format_summary(s: dict[str, Any], rate: float) -> str:
    """vLLM's result table of one run's :func:`summarize` output."""
    rows = [
        ("Request rate (req/s)", f"{rate:g}"),
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", f"{s['duration']:.2f}"),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    if "request_goodput" in s:
        rows.append(("Request goodput (req/s)", f"{s['request_goodput']:.2f}"))
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        for st in ("mean", "median", "p90", "p99"):
            rows.append((f"{st.capitalize()} {title} (ms)", f"{s[f'{st}_{name}_ms']:.2f}"))
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    lines += [f"  failure: {reason}: {n}" for reason, n in s["failures"].items()]
    lines.append("=" * 60)
    return "\n".join(lines)


def _cpu() -> dict[str, Any]:
    """Model name, logical CPUs, the ``flags`` line of /proc/cpuinfo (Linux) and torch's CPU ISA."""
    info: dict[str, Any] = {"logical_cpus": os.cpu_count(), "machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and "model" not in info:
            info["model"] = value.strip()
        elif key in ("flags", "Features") and "flags" not in info:
            info["flags"] = sorted(value.split())
    try:
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception as exc:  # torch is the client's optional extra here: say why it is missing
        info["torch_cpu_capability"] = f"unknown ({type(exc).__name__})"
    return info


def _gpus() -> list[dict[str, str]] | str:
    """This machine's GPUs from ``nvidia-smi`` (name, memory, driver), or why there are none listed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "no nvidia-smi on PATH"
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed: {type(exc).__name__}"
    gpus = []
    for line in out.strip().splitlines():
        name, mem, driver = (part.strip() for part in (line.split(",") + ["", ""])[:3])
        gpus.append({"name": name, "memory": mem, "driver": driver})
    return gpus


def _git_commit() -> str | None:
    """The commit of the checkout this package runs from (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """The client machine: UTC date, OS, Python, CPU (model, flags, torch's ISA), GPUs, package versions and
    layerzero's git commit; recorded in every result JSON (the server's own ``/version`` sits beside it)."""
    versions = {}
    for pkg in (
        "layerzero",
        "torch",
        "transformers",
        "numpy",
        "httpx",
        "aiohttp",
        "triton",
        "flashinfer-python",
    ):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu(),
        "gpus": _gpus(),
        "versions": versions,
        "git_commit": _git_commit(),
    }


def plot_sweep(rows: Sequence[dict[str, Any]], path: Path) -> str | None:
    """Plot median and p99 TTFT and TPOT (ms) against the request rate (one point per run of ``rows``, each a
    :func:`summarize` output with ``request_rate``; ``inf`` plotted last) to ``path`` (PNG). Returns None, or
    why no plot was written (matplotlib not installed), which is also logged."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        reason = f"matplotlib is not installed ({exc}); no plot written (pip install matplotlib)"
        log.warning("bench-serve: %s", reason)
        return reason
    labels = [f"{r['request_rate']:g}" for r in rows]
    x = list(range(len(rows)))
    fig = Figure(figsize=(10, 4), tight_layout=True)
    for ax, metric, title in zip(fig.subplots(1, 2), ("ttft", "tpot"), ("TTFT", "TPOT"), strict=True):
        for st, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(x, [r[f"{st}_{metric}_ms"] for r in rows], style, label=f"{st}")
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs request rate")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=120)
    return None
