"""Cold start of the serving engine: ``layerzero bench-engine``'s workload (nano-vllm's) run twice in a fresh
process, with the start-up warm-up on and off (``LLM(warmup=...)``), each in its own subprocess, with an empty
and then a populated compile cache (Triton's ``TRITON_CACHE_DIR``; FlashInfer's ``FLASHINFER_WORKSPACE_BASE``
with ``--isolate-flashinfer``). Per process: start-up seconds (``LLM(...)``; the warm-up's share and dummy
runs), seconds from the process start to a ready engine, output tok/s of the first and second run, their
ratio (the target: the first within 3% of the second; the prefix cache is emptied before each run, so a later
run does not skip the prefills the run before cached: ``--keep-prefix-cache`` keeps it, as issue 37's first
measurement did), and the Triton kernels and FlashInfer modules compiled
during start-up and during each run (new cache entries). Writes a Markdown page with the machine (CPU flags,
GPU, versions, date).

Usage::

    PYTHONPATH=src python benchmarks/engine/cold_start.py --scale cpu --device cpu --threads 4 \\
        --out benchmarks/results/engine/cold_start_cpu.md
    PYTHONPATH=src python benchmarks/engine/cold_start.py --out $OUT/cold_start.md   # the H200, full scale

``--child`` is the subprocess (one JSON line on stdout); the parent never builds an engine itself.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _entries(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} if path.is_dir() else set()


def _modules(path: Path) -> set[str]:
    return {str(p) for p in path.rglob("*.so")} if path.is_dir() else set()


def _misses() -> tuple[int, int]:
    """(identity of LayerZero's selection cache, its misses so far): a miss per new shape bucket selected."""
    from layerzero.core.runtime import RUNTIME

    cache = RUNTIME.cache
    return id(cache), cache.stats().misses


class _Compiles:
    """New Triton cache entries (one per compiled kernel variant), FlashInfer ``*.so`` modules and LayerZero
    selections (selection-cache misses: new shape buckets) since the last :meth:`take`."""

    def __init__(self) -> None:
        self.triton = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
        self.fi = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", Path.home() / ".cache" / "flashinfer"))
        self.seen = (_entries(self.triton), _modules(self.fi))
        self.misses = _misses()

    def take(self) -> dict[str, int]:
        now = (_entries(self.triton), _modules(self.fi))
        new = [len(a - b) for a, b in zip(now, self.seen, strict=True)]
        self.seen = now
        m = _misses()
        sel = m[1] - self.misses[1] if m[0] == self.misses[0] else m[1]  # a rebuilt cache counts from 0
        self.misses = m
        return {"triton": new[0], "flashinfer": new[1], "selections": sel}


def child(a: argparse.Namespace) -> dict[str, Any]:
    """One fresh process: build the engine, then the workload twice (after bench-engine's one warm-up
    request)."""
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from layerzero.engine import LLM, SamplingParams
    from layerzero.engine.tools.bench import default_checkpoint, make_workload

    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    path = Path(a.model) if a.model else default_checkpoint(a.scale, dt)
    w = make_workload(a.scale)
    compiles = _Compiles()
    t0 = time.perf_counter()
    llm = LLM(
        path,
        device=str(dev),
        dtype=dt,
        max_model_len=max(len(p) for p in w.prompts) + max(w.max_tokens) + 16,
        warmup=a.warmup == "on",
        **{k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in a.opt)},
    )
    startup = time.perf_counter() - t0
    ready = time.time() - a.spawned
    st = llm.stats()
    out: dict[str, Any] = {
        "warmup": a.warmup,
        "cache": a.cache,
        "startup_s": startup,
        "ready_s": ready,
        "warmup_s": st["warmup_s"],
        "warmup_shapes": st["warmup_shapes"],
        "startup_compiles": compiles.take(),
    }
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # bench-engine's warm-up request
    out["request_compiles"] = compiles.take()
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in w.max_tokens]
    runs = []
    for _ in range(a.runs):
        if not a.keep_prefix_cache and not llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be emptied: a request still holds blocks")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(w.prompts, params, use_tqdm=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - t
        runs.append({"seconds": took, "tok_s": w.output_tokens / took, "compiles": compiles.take()})
    out["runs"] = runs
    out["prefix_cache"] = _prefix_cache(a)
    out["first_over_second"] = runs[0]["tok_s"] / runs[1]["tok_s"]
    return out


def _prefix_cache(a: argparse.Namespace) -> str:
    return "kept between runs" if a.keep_prefix_cache else "emptied before each run"


def _machine(device: str) -> dict[str, Any]:
    import torch

    from layerzero.core.device import DeviceSpec

    cpu = DeviceSpec.detect(torch.device("cpu"))
    flags = sorted(f for f in cpu.cpu_isa if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("triton", "flashinfer", "layerzero"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or without a version
            versions[mod] = None
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu.name or platform.machine(),
        "cores": os.cpu_count(),
        "cpu_flags": flags,
        "gpu": gpu,
        **versions,
    }


def _spawn(a: argparse.Namespace, warmup: str, cache: str, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE), "--child", "--warmup", warmup, "--cache", cache]
    cmd += ["--scale", a.scale, "--device", a.device, "--runs", str(a.runs), "--spawned", repr(time.time())]
    cmd += ["--keep-prefix-cache"] if a.keep_prefix_cache else []
    cmd += [f"--opt={o}" for o in a.opt]
    cmd += (["--threads", str(a.threads)] if a.threads else []) + (["--model", a.model] if a.model else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"child {warmup}/{cache} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _row(r: dict[str, Any]) -> str:
    c = r["startup_compiles"]
    runs = r["runs"]
    per = " / ".join(
        f"{x['compiles']['triton'] + x['compiles']['flashinfer']}, {x['compiles']['selections']}"
        for x in runs
    )
    return (
        f"| {r['warmup']} | {r['cache']} | {r['startup_s']:.2f} | {r['warmup_s']:.2f} | {r['warmup_shapes']} "
        f"| {r['ready_s']:.2f} | {c['triton']} + {c['flashinfer']}, {c['selections']} | "
        + " / ".join(f"{x['tok_s']:,.0f}" for x in runs)
        + f" | {r['first_over_second']:.3f} | {per} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=("full", "cpu"), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="checkpoint (default: bench-engine's of --scale)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--opt", action="append", default=[], help="LLM option key=python-literal (repeatable)")
    ap.add_argument("--runs", type=int, default=2, help="workload runs per process (>= 2)")
    ap.add_argument(
        "--keep-prefix-cache",
        action="store_true",
        help="keep the prefix cache between runs (a later run then skips the prefills an earlier one cached)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="processes per (warm-up, cache) cell")
    ap.add_argument("--warmups", default="on,off", help="which warm-up cells to run (comma-separated)")
    ap.add_argument("--cache-root", default=None, help="where the compile caches go (default: a temp dir)")
    ap.add_argument("--isolate-flashinfer", action="store_true", help="FlashInfer's workspace per cell too")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    ap.add_argument("--out", type=Path, default=None, help="Markdown page to write")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spawned", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.runs = max(2, a.runs)
    bad = [w for w in a.warmups.split(",") if w not in ("on", "off")]
    if bad or not a.warmups:
        ap.error(f"--warmups: expected a comma-separated subset of on,off, got {a.warmups!r}")
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return 0
    import torch

    from layerzero.engine.tools.bench import default_checkpoint

    if not a.model:  # built once here, so no child's start-up pays for writing it
        default_checkpoint(a.scale, torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    root = Path(a.cache_root or tempfile.mkdtemp(prefix="lz_cold_"))
    rows = []
    for rnd in range(a.rounds):
        for warmup in [w for w in ("on", "off") if w in a.warmups.split(",")]:
            caches = root / f"{warmup}{rnd}"  # empty for the first process, populated by it for the second
            env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"))
            if a.isolate_flashinfer:
                env["FLASHINFER_WORKSPACE_BASE"] = str(caches / "flashinfer")
            for cache in ("empty", "populated"):
                r = _spawn(a, warmup, cache, env)
                rows.append(r)
                print(_row(r), flush=True)
    head = (
        "| warm-up | compile cache | start-up s | warm-up s | warm-up shapes | process to ready s "
        "| start-up: compiled (Triton + FlashInfer), selections | run tok/s | first / second "
        "| per run: compiled, selections |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    cmd = "python benchmarks/engine/cold_start.py " + " ".join(argv if argv is not None else sys.argv[1:])
    page = (
        f"# Engine cold start ({a.scale} scale, {a.device})\n\n`{cmd}`\n\n"
        f"Machine: `{json.dumps(_machine(a.device))}`\n\n"
        f"Prefix cache: {_prefix_cache(a)}."
        f"\n\n{head}\n"
        + "\n".join(_row(r) for r in rows)
        + "\n\n<details><summary>raw</summary>\n\n```json\n"
        + json.dumps(rows, indent=1)
        + "\n```\n</details>\n"
    )
    print(page)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
