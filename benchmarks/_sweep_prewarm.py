"""Parallel JIT warm-up for the sweep: compile every JIT kernel the sweep will call before timing starts.

FlashInfer builds one CUDA module per (kernel family, dtype, head dim, ...) with nvcc (~45 s each for its sm90
prefill modules on the H200 host) and Triton compiles per specialization; done one by one inside the sweep
that would spend its whole budget compiling. Here each distinct *signature* (phase, dtype, head dim, GQA
ratio, page size) becomes a tiny shape that a worker process runs through every eligible kernel once, up to
``procs`` workers at a time. The compiled artefacts land in the on-disk caches both libraries keep
(FlashInfer's JIT directory under ``$FLASHINFER_WORKSPACE_BASE``, Triton's ``~/.triton/cache``), so the sweep
process loads them instead of compiling. ``torch.compile`` (flex_attention.compiled) compiles per shape and is
not helped.

Usage (module API): ``prewarm(shapes, procs=12) -> (seconds, failures)``; a worker is
``python benchmarks/_sweep_prewarm.py '<json shape>'``. ``run_workers(commands, procs)`` is the process pool
itself (``ship_timings.py`` runs its own workers with it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sweep_shapes import Shape  # noqa: E402


def tiny(shape: Shape) -> Shape:
    """The smallest shape that compiles the same JIT kernels as ``shape``: batch 2, a few tokens; heads, head
    dim, dtype and page size kept (they select the kernel variant)."""
    if shape.phase == "prefill":
        return replace(shape, batch=2, q_len=16, kv_len=16)
    if shape.phase == "paged_append":
        return replace(shape, batch=2, q_len=8, kv_len=max(64, 4 * shape.page))
    return replace(shape, batch=2, q_len=1, kv_len=max(64, 4 * shape.page))


def signatures(shapes: list[Shape]) -> list[Shape]:
    """One tiny shape per distinct (phase, dtype, head dim, Hq, Hkv, page) of ``shapes``, in first-seen
    order."""
    seen: dict[tuple, Shape] = {}
    for s in shapes:
        seen.setdefault((s.phase, s.dtype, s.head_dim, s.hq, s.hkv, s.page), tiny(s))
    return list(seen.values())


def prewarm(shapes: list[Shape], procs: int = 12, timeout_s: float = 300.0) -> tuple[float, list[str]]:
    """Run a worker per signature of ``shapes`` (at most ``procs`` at once); returns (wall seconds, failure
    messages). Never raises for a failing worker: the sweep then compiles that kernel itself."""
    return run_workers(
        [[sys.executable, __file__, json.dumps(asdict(s))] for s in signatures(shapes)], procs, timeout_s
    )


def run_workers(
    commands: list[list[str]], procs: int = 12, timeout_s: float = 300.0
) -> tuple[float, list[str]]:
    """Run each command (an argv list) as a worker process, at most ``procs`` at once; workers still running
    ``timeout_s`` seconds after the pool started are killed. Returns (wall seconds, failure messages with each
    failed worker's last output). Never raises for a failing worker. Used by this module and by
    ``ship_timings.py`` / ``hidden_shapes.py``."""
    t0 = time.monotonic()
    todo = list(commands)
    running: list[tuple[subprocess.Popen, str]] = []
    failures: list[str] = []
    while todo or running:
        while todo and len(running) < procs:
            argv = todo.pop(0)
            spec = argv[-1]
            running.append(
                (subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), spec)
            )
        for p, spec in list(running):
            if p.poll() is None and time.monotonic() - t0 < timeout_s:
                continue
            if p.poll() is None:
                p.kill()
            out = p.communicate()[0]
            if p.returncode != 0:
                failures.append(f"{spec}: exit {p.returncode}: {out.strip()[-300:]}")
            running.remove((p, spec))
        time.sleep(0.2)
    return time.monotonic() - t0, failures


def _worker(spec: str) -> int:
    """Call every eligible kernel of one tiny shape once (compiles it); print what failed."""
    import torch
    from _sweep_shapes import build_inputs

    import layerzero as lz
    from layerzero.core.report import CandidateStatus
    from layerzero.core.runtime import RUNTIME
    from layerzero.ops import OPS
    from layerzero.tuning import bind

    shape = Shape(**json.loads(spec))
    device = torch.device(os.environ.get("LZ_SWEEP_DEVICE", "cuda"))
    inputs = build_inputs(shape, device)
    report = lz.explain(shape.op, *inputs.args, **inputs.kwargs)
    _, canonical = OPS[shape.op][0](*inputs.args, **inputs.kwargs)
    bad = 0
    for cand in report.candidates:
        if cand.status is CandidateStatus.REJECTED or cand.kernel_id.startswith(
            ("reference.", "flex_attention.")
        ):
            continue
        try:
            bind(RUNTIME.registry, RUNTIME.registry.kernel(cand.kernel_id, shape.op), report.context)(
                *canonical
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - report and go on: the sweep records the kernel's failure itself
            bad += 1
            print(f"{cand.kernel_id}: {type(exc).__name__}: {str(exc)[:200]}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
