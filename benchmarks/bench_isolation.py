"""Call overhead of an isolated kernel (``layerzero.isolation``: worker process, shared memory or CUDA IPC,
JSON headers) against the same function in-process, on CPU or on a CUDA device.

Usage: ``PYTHONPATH=src python benchmarks/bench_isolation.py [--device cuda] [--out
FILE]`` (default ``benchmarks/results/isolation_<device>.md``). Kernels: identity (pure transport: copy in,
copy out) and rms_norm (float32), called directly (``IsolatedBackend.call`` vs the plain function) and through
``lz.rms_norm`` with the kernel locked. Median of ``--reps`` calls after warm-up, each ended by a device
synchronize on CUDA; MB/s counts the input plus the output bytes moved per call (on CUDA nothing crosses the
socket but the IPC handles: inputs are shared, each result is cloned on the caller's device).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import layerzero as lz
from layerzero.isolation import IsolatedBackend

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "integration"))
import _isolated_kernels as K  # noqa: E402  (the same module the worker imports)


def _median_us(fn, reps: int, sync=lambda: None) -> float:
    for _ in range(min(reps, 20)):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                f = set(line.split(":", 1)[1].split())
                return " ".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in f)
    except OSError:
        pass
    return "?"


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=200)
    ns = ap.parse_args()
    dev = ns.device
    out = ns.out or str(HERE / "results" / f"isolation_{dev}.md")
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.set_num_threads(1)
    t_start = time.time()
    rows = []
    with IsolatedBackend(path=[str(HERE.parent / "tests" / "integration")], name="bench") as b:
        t0 = time.perf_counter()
        b.start()
        start_s = time.perf_counter() - t0
        lz.register_isolated_kernel(
            "rms_norm",
            "benchiso.rms",
            "_isolated_kernels:rms_norm",
            backend=b,
            dtypes={"float32"},
            device_types={dev},
        )
        for shape in ((1, 64), (16, 4096), (1024, 4096), (8192, 4096)):
            x, w = torch.randn(*shape, device=dev), torch.randn(shape[-1], device=dev)
            reps = ns.reps if x.numel() < 1 << 22 else max(20, ns.reps // 10)
            mb = 2 * x.numel() * 4 / 1e6
            ident_in = _median_us(lambda x=x, w=w: K.identity(x), reps, sync)
            ident_iso = _median_us(lambda x=x, w=w: b.call("_isolated_kernels:identity", x), reps, sync)
            rms_in = _median_us(lambda x=x, w=w: K.rms_norm(x, w, 1e-6, None), reps, sync)
            rms_iso = _median_us(
                lambda x=x, w=w: b.call("_isolated_kernels:rms_norm", x, w, 1e-6, None), reps, sync
            )
            lz.lock("rms_norm", "benchiso.rms")
            rms_lz = _median_us(lambda x=x, w=w: lz.rms_norm(x, w), reps, sync)
            lz.unlock("rms_norm")
            rms_lz_native = _median_us(lambda x=x, w=w: lz.rms_norm(x, w), reps, sync)
            rows.append(
                (
                    shape,
                    x.numel() * 4,
                    ident_in,
                    ident_iso,
                    mb / (ident_iso / 1e6),
                    rms_in,
                    rms_iso,
                    rms_iso - rms_in,
                    rms_lz,
                    rms_lz_native,
                )
            )
            print(rows[-1], flush=True)
        lz.unregister_kernel("benchiso.rms")
    lines = [
        f"# Isolated kernel call overhead ({dev.upper()})",
        "",
        f"- date: {datetime.date.today().isoformat()}; wall time of the run {time.time() - t_start:.0f} s",
        f"- machine: {_cpu_name()}, {torch.get_num_threads()} torch thread, Linux {platform.machine()}; "
        f"CPU flags: {_cpu_flags()}"
        + (f"; GPU {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if dev == "cuda" else ""),
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}; worker: same "
        "interpreter",
        f"- worker start (spawn + import torch + ready): {start_s * 1e3:.0f} ms",
        f"- median of {ns.reps} calls (largest shape: {max(20, ns.reps // 10)}) after warm-up; float32; "
        "generated by benchmarks/bench_isolation.py",
        "",
        "| shape | bytes in | identity in-proc µs | identity isolated µs | isolated MB/s (in+out) | rms_norm "
        "in-proc µs | rms_norm isolated µs | overhead µs | lz.rms_norm locked isolated µs | lz.rms_norm "
        "default µs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {list(r[0])} | {r[1]:,} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:,.0f} | {r[5]:.1f} | {r[6]:.1f} | "
            f"{r[7]:.1f} | {r[8]:.1f} | {r[9]:.1f} |"
        )
    lines += [
        "",
        "Transport per call on CPU: one copy of each input into the client's arena, one copy of each output "
        "into the worker's arena, one copy out of it (`clone`), two JSON frames on a Unix socket pair and "
        "two context switches. On CUDA: each input's IPC handle (opened once per allocation by the worker), "
        "the result's handle back, one device clone of it and a synchronize.",
        "",
    ]
    Path(out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
