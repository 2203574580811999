"""Measure the shipped timing data of this machine: every eligible kernel on a broad shape grid, written as
``src/layerzero/data/timings/<device>.json`` (see ``layerzero/core/shipped.py`` for the format and matching).

Each case of the grid (``_ship_grid.gpu_grid`` on CUDA: dense prefill / decode / cross-attention, ragged paged
decode and append, rms_norm / rope / swiglu; ``cpu_grid`` on the CPU) is one ``lz.<op>`` call; its eligible
kernels are checked against the reference kernel and timed with the ``lz.tune`` harness
(``layerzero.tuning.autotune.measure_context``). Kernels that fail the check or raise are not recorded. Cases
of one context bucket are combined (geometric mean of each kernel measured in all of them). Only medians are
stored, with the fingerprint (device, SM or CPU ISA level, torch, cuDNN) and the measured backends' versions.

Usage::

    # GPU (H100/H200: about 6-7 minutes with the JIT pre-warm; --part splits it over several calls)
    PYTHONPATH=src python benchmarks/ship_timings.py --out benchmarks/results/ship_timings/h100
    PYTHONPATH=src python benchmarks/ship_timings.py --part 1/2 --out /tmp/a   # then --part 2/2 --out /tmp/b
    PYTHONPATH=src python benchmarks/ship_timings.py --merge /tmp/a/timings/*.part1of2.json \\
        /tmp/b/timings/*.part2of2.json --out benchmarks/results/ship_timings/h100
    # CPU (the committed CPU file; ~6 minutes on 2 cores)
    PYTHONPATH=src python benchmarks/ship_timings.py --device cpu --out benchmarks/results/ship_timings/cpu

``--max-minutes`` (default 7) is a budget for the whole run, JIT pre-warm included: cases not started by then
are left out (the file says how many were measured). Without ``--part`` (or after ``--merge``) the file is
installed into ``src/layerzero/data/timings`` unless ``--no-install``; a copy goes to ``--out``/timings/ (a
directory of data files only, usable as ``lz.configure(shipped_timings_dir=...)`` or
``hidden_shapes.py --shipped-dir``), ``ship_timings.csv`` (every kernel of every case) and ``env.json`` to
``--out``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import logging
import math
import random
import re
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ship_grid import KINDS, Case, cpu_grid, gpu_grid, quick_grid  # noqa: E402
from _ship_measure import Measured, measure_rounds, prewarm_cases  # noqa: E402
from _sweep_report import collect_env, write_csv  # noqa: E402

from layerzero.core import shipped  # noqa: E402
from layerzero.core.device import DeviceSpec  # noqa: E402
from layerzero.core.errors import ConfigurationError, expected_got  # noqa: E402
from layerzero.core.runtime import RUNTIME  # noqa: E402

__all__ = [
    "DATA_DIR",
    "build_document",
    "combine",
    "compact",
    "expand",
    "dump_document",
    "main",
    "merge_documents",
    "run",
    "select_part",
    "slug",
]

log = logging.getLogger("layerzero.benchmarks.ship")
DATA_DIR = Path(__file__).resolve().parents[1] / "src" / "layerzero" / "data" / "timings"
CSV_COLUMNS = (
    "case",
    "kind",
    "op",
    "label",
    "bucket",
    "kernel_id",
    "status",
    "median_us",
    "p95_us",
    "samples",
    "max_error",
    "detail",
)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def slug(device: DeviceSpec | dict[str, str]) -> str:
    """The data file's stem, from a device or a file's fingerprint: the GPU name (``nvidia-h100-80gb-hbm3``)
    or ``cpu-<arch>-<isa level>``."""
    fp = shipped.device_fingerprint(device) if isinstance(device, DeviceSpec) else device
    if fp["device_type"] == "cpu":
        return f"cpu-{fp['arch']}-{fp['isa']}"
    return re.sub(r"[^a-z0-9]+", "-", fp.get("name", "").lower()).strip("-") or fp["device_type"]


def combine(cases: list[dict[str, float]]) -> dict[str, float]:
    """Geometric mean per kernel over the cases of one bucket, for kernels measured in all of them (µs)."""
    common = set(cases[0]) if cases else set()
    for m in cases[1:]:
        common &= set(m)
    return {
        k: round(math.exp(sum(math.log(max(m[k], 1e-3)) for m in cases) / len(cases)), 3)
        for k in sorted(common)
    }


def build_document(
    measured: list[Measured], device: DeviceSpec, *, tool: str, planned: int
) -> dict[str, Any]:
    """The data file of ``measured`` cases (see ``core/shipped.py``): fingerprint of ``device``, the versions
    of every backend with a recorded kernel, one record per bucket."""
    by_bucket: dict[str, tuple[str, dict[str, Any], list[dict[str, float]]]] = {}
    for m in measured:
        ok = m.ok()
        if not ok:
            continue
        fields = shipped.bucket_fields(m.ctx)
        key = m.ctx.op + "|" + m.ctx.bucket_key()
        by_bucket.setdefault(key, (m.ctx.op, fields, []))[2].append(ok)
    records = []
    for op, fields, medians in by_bucket.values():
        combined = combine(medians)
        if combined:
            records.append((op, fields, combined))
    reg = RUNTIME.registry
    backends = sorted({reg.kernels.get(k).backend for _, _, med in records for k in med})
    return compact(
        {
            "schema": shipped.SCHEMA_VERSION,
            "fingerprint": shipped.device_fingerprint(device),
            "backends": {b: str(reg.backends.get(b).version) for b in backends},
            "date": datetime.date.today().isoformat(),
            "tool": tool,
            "device": str(device),
            "cases": {"planned": planned, "measured": len(measured)},
        },
        records,
    )


def compact(
    header: dict[str, Any], records: list[tuple[str, dict[str, Any], dict[str, float]]]
) -> dict[str, Any]:
    """``header`` plus ``defaults`` (per op, the fields every record of the op shares) and the records as
    ``[op, fields not in defaults, medians]`` (a field of the defaults a record lacks is written as null)."""
    defaults: dict[str, dict[str, Any]] = {}
    for op in sorted({r[0] for r in records}):
        mine = [r[1] for r in records if r[0] == op]
        defaults[op] = {k: v for k, v in mine[0].items() if all(k in f and f[k] == v for f in mine)}
    rows = []
    for op, fields, medians in sorted(records, key=lambda r: (r[0], sorted(r[1].items(), key=str))):
        d = defaults[op]
        delta = {k: v for k, v in fields.items() if k not in d or d[k] != v}
        delta.update({k: None for k in d if k not in fields})
        rows.append([op, delta, medians])
    return {**header, "defaults": defaults, "records": rows}


def expand(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, float]]]:
    """The records of a data document with their full fields."""
    out = []
    for op, delta, medians in doc["records"]:
        fields = {k: v for k, v in {**doc.get("defaults", {}).get(op, {}), **delta}.items() if v is not None}
        out.append((op, fields, medians))
    return out


def merge_documents(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from partial ones (``--part`` runs): the same fingerprint and backend versions are
    required; records of one bucket in several parts are combined like cases of one bucket.

    Raises:
        ConfigurationError: no documents, or fingerprints / backend versions that differ.
    """
    if not docs:
        raise ConfigurationError(expected_got("ship_timings --merge", "at least one partial file", "none"))
    first = docs[0]
    backends: dict[str, str] = {}
    for d in docs:
        if d["fingerprint"] != first["fingerprint"]:
            raise ConfigurationError(
                expected_got(
                    "ship_timings --merge fingerprint",
                    first["fingerprint"],
                    d["fingerprint"],
                    "Merge only parts measured on one machine.",
                )
            )
        for b, v in d["backends"].items():
            if backends.setdefault(b, v) != v:
                raise ConfigurationError(
                    expected_got(f"ship_timings --merge: backend {b} version", backends[b], v)
                )
    groups: dict[str, tuple[str, dict[str, Any], list[dict[str, float]]]] = {}
    for d in docs:
        for op, fields, medians in expand(d):
            key = op + "|" + ";".join(f"{k}={v}" for k, v in sorted(fields.items()))
            groups.setdefault(key, (op, fields, []))[2].append(medians)
    records = [(op, fields, combine(meds)) for op, fields, meds in groups.values()]
    planned = sum(d.get("cases", {}).get("planned", 0) for d in docs)
    measured = sum(d.get("cases", {}).get("measured", 0) for d in docs)
    header = {k: v for k, v in first.items() if k not in ("records", "defaults", "backends", "cases", "tool")}
    header.update(
        backends=dict(sorted(backends.items())),
        tool=" + ".join(d.get("tool", "") for d in docs),
        cases={"planned": planned, "measured": measured},
    )
    return compact(header, [r for r in records if r[2]])


def dump_document(doc: dict[str, Any], path: Path) -> int:
    """Write ``doc`` as compact JSON, one record per line; checks it parses (``shipped.parse``); returns
    bytes."""
    head = {k: v for k, v in doc.items() if k != "records"}
    text = json.dumps(head, separators=(",", ":"), sort_keys=True)[:-1] + ',"records":[\n'
    text += (
        ",\n".join(json.dumps(r, separators=(",", ":"), sort_keys=True) for r in doc["records"]) + "\n]}\n"
    )
    shipped.parse(text, path.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return len(text.encode())


def _rows(i: int, m: Measured) -> list[dict[str, Any]]:
    return [
        {
            "case": i,
            "kind": m.case.kind,
            "op": m.case.op,
            "label": m.case.label(),
            "bucket": m.ctx.bucket_key(),
            "kernel_id": r.kernel_id,
            "status": r.status.value,
            "median_us": r.median_us,
            "p95_us": r.p95_us,
            "samples": r.samples,
            "max_error": r.max_error,
            "detail": r.detail[:200],
        }
        for r in m.rows
    ]


def run(
    cases: list[Case],
    device: torch.device,
    *,
    timing: dict[str, Any],
    budget_s: float,
    exclude: tuple[str, ...] = (),
    materializing_gib_max: float = 2.0,
    rounds: int = 1,
) -> tuple[list[Measured], list[dict]]:
    """Measure ``cases`` in order (each ``rounds`` times, see :func:`measure_rounds`) until ``budget_s``
    seconds are spent; returns (measured cases, CSV rows). A case that raises (out of memory, say) is logged
    and skipped."""
    t0 = time.monotonic()
    measured: list[Measured] = []
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(cases):
        if time.monotonic() - t0 > budget_s:
            _say(f"budget: stopped after {i} of {len(cases)} cases; measure the rest with --part")
            break
        try:
            m = measure_rounds(case, device, timing, exclude, materializing_gib_max, rounds)
        except Exception as exc:  # noqa: BLE001 - one broken case must not end the run
            log.warning("ship_timings: %s failed (%s: %s); skipped", case.label(), type(exc).__name__, exc)
            rows.append(
                {
                    "case": i,
                    "kind": case.kind,
                    "op": case.op,
                    "label": case.label(),
                    "status": "error",
                    "detail": f"{type(exc).__name__}: {str(exc)[:200]}",
                }
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        measured.append(m)
        rows += _rows(i, m)
        best = m.fastest()
        _say(
            f"[{i + 1}/{len(cases)}] {case.label()}: {len(m.ok())} ok, fastest "
            f"{'-' if best is None else f'{best[0]} {best[1]:.1f} us'} ({time.monotonic() - t0:.0f} s)"
        )
    return measured, rows


def _part(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"--part: expected i/n with 1 <= i <= n, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def select_part(cases: list[Case], part: tuple[int, int] | None) -> list[Case]:
    """The cases of part ``i/n``: whole JIT signatures (so each part compiles only its own), the largest first
    to the part with the fewest cases so far (parts of about equal size); then shuffled with a fixed seed (a
    budget cut then thins every family alike)."""
    if part is not None:
        sizes = Counter(c.signature for c in cases)
        load = [0] * part[1]
        owner = {}
        for sig, n in sorted(sizes.items(), key=lambda kv: (-kv[1], str(kv[0]))):
            j = load.index(min(load))
            owner[sig], load[j] = j, load[j] + n
        cases = [c for c in cases if owner[c.signature] == part[0] - 1]
    out = list(cases)
    random.Random(0).shuffle(out)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default benchmarks/results/ship_timings/<device>)",
    )
    p.add_argument("--no-install", action="store_true", help=f"do not write the file into {DATA_DIR}")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR, help=argparse.SUPPRESS)
    p.add_argument(
        "--dtypes", nargs="+", default=None, help="dtypes (default bfloat16 on CUDA, float32 bfloat16 on CPU)"
    )
    p.add_argument("--kinds", nargs="+", default=None, choices=KINDS, help="only these case kinds")
    p.add_argument("--max-minutes", type=float, default=7.0, help="budget in minutes (default 7)")
    p.add_argument(
        "--part",
        type=_part,
        default=None,
        help="measure part i of n (i/n) into <out>/timings/<name>.partIofN.json",
    )
    p.add_argument(
        "--retry-errors",
        type=Path,
        default=None,
        metavar="CSV",
        help="measure again only the cases "
        "that raised in an earlier run (rows with status 'error' in its ship_timings.csv); the file counts "
        "them as measured but not planned, so --merge with the earlier file gives the right totals",
    )
    p.add_argument("--merge", nargs="+", type=Path, default=None, help="merge partial files (no measuring)")
    p.add_argument("--quick", action="store_true", help="a few tiny cases (CPU tests)")
    p.add_argument("--limit", type=int, default=None, help="only the first N cases (after --part)")
    p.add_argument(
        "--exclude",
        nargs="*",
        default=None,
        help="kernel id globs not measured (default flex_attention.compiled on CPU; flex_attention.* "
        "(opt-in, compiled per shape) and reference.* on CUDA)",
    )
    p.add_argument(
        "--prewarm-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds the JIT pre-warm may "
        "take (default min(180, 40%% of the budget); FlashInfer compiles took ~60-100 s per module on an "
        "H100 machine with 12 in parallel)",
    )
    p.add_argument(
        "--prewarm",
        type=int,
        default=None,
        metavar="N",
        help="compile JIT kernels first in N worker "
        "processes (default 12 on CUDA, 0 elsewhere; outside the budget)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3, help="calls per sample (default 3)")
    p.add_argument("--repeats", type=int, default=5, help="samples per kernel at most (default 5)")
    p.add_argument(
        "--max-time-ms", type=float, default=20.0, help="sampling budget per kernel, ms (default 20)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure each case this many times and keep each "
        "kernel's smallest median (default 1; more on a shared CPU)",
    )
    p.add_argument(
        "--materializing-gib-max",
        type=float,
        default=2.0,
        help="skip reference / SDPA math / eager flex above this score matrix size (GiB, default 2)",
    )
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads on CPU (default torch's)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = "python benchmarks/ship_timings.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        _say("ship_timings: --device cuda but CUDA is not available; use --device cpu")
        return 2
    spec = DeviceSpec.detect(device)
    doc = merge_documents([json.loads(p.read_text()) for p in args.merge]) if args.merge else None
    name = slug(
        spec if doc is None else doc["fingerprint"]
    )  # --merge: the measured machine's name, not this one's
    out = args.out or Path(__file__).resolve().parent / "results" / "ship_timings" / name
    out.mkdir(parents=True, exist_ok=True)
    if doc is not None:
        return _finish(doc, out, name, args, part=None)
    if device.type == "cpu" and args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    RUNTIME.ensure_ready()
    if args.quick:
        cases = quick_grid()
    elif device.type == "cuda":
        cases = gpu_grid(tuple(args.dtypes or ("bfloat16",)))
    else:
        cases = cpu_grid(tuple(args.dtypes or ("float32", "bfloat16")))
    if args.kinds:
        cases = [c for c in cases if c.kind in args.kinds]
    planned = None
    if args.retry_errors:
        with args.retry_errors.open(newline="") as f:
            again = {r["label"] for r in csv.DictReader(f) if r["status"] == "error"}
        cases, planned = [c for c in cases if c.label() in again], 0
        _say(f"retry: {len(cases)} cases that raised in {args.retry_errors}")
    cases = select_part(cases, args.part)[: args.limit]
    exclude = (
        tuple(args.exclude)
        if args.exclude is not None
        else (("flex_attention.*", "reference.*") if device.type == "cuda" else ("flex_attention.compiled",))
    )
    procs = args.prewarm if args.prewarm is not None else (12 if device.type == "cuda" else 0)
    t0 = time.monotonic()
    if procs > 0:
        took, failures = prewarm_cases(
            cases, device, procs, timeout_s=args.prewarm_timeout or min(180.0, 0.4 * args.max_minutes * 60)
        )
        _say(
            f"prewarm: {len({c.signature for c in cases})} JIT signatures in {took:.0f} s with {procs} "
            "workers"
            + (f"; {len(failures)} reported failures:\n  " + "\n  ".join(failures) if failures else "")
        )
    timing = {
        "warmup": args.warmup,
        "iters": args.iters,
        "repeats": args.repeats,
        "max_time_s": args.max_time_ms / 1e3,
    }
    measured, rows = run(
        cases,
        device,
        timing=timing,
        budget_s=args.max_minutes * 60 - (time.monotonic() - t0),
        exclude=exclude,
        materializing_gib_max=args.materializing_gib_max,
        rounds=args.rounds,
    )
    write_csv(out / "ship_timings.csv", rows, CSV_COLUMNS)
    env = collect_env(device) if device.type == "cuda" else {"device": str(spec), "torch": torch.__version__}
    env.update(
        command=command,
        cases_planned=len(cases),
        cases_measured=len(measured),
        elapsed_s=round(time.monotonic() - t0, 1),
        timing=timing,
        rounds=args.rounds,
        exclude=list(exclude),
        fingerprint=shipped.device_fingerprint(spec),
        statuses=dict(Counter(r["status"] for r in rows)),
    )
    (out / "env.json").write_text(json.dumps(env, indent=2, default=str) + "\n")
    doc = build_document(measured, spec, tool=command, planned=len(cases) if planned is None else planned)
    return _finish(doc, out, name, args, part=args.part)


def _finish(
    doc: dict[str, Any], out: Path, name: str, args: argparse.Namespace, part: tuple[int, int] | None
) -> int:
    fname = f"{name}.part{part[0]}of{part[1]}.json" if part else f"{name}.json"
    size = dump_document(doc, out / "timings" / fname)
    _say(f"wrote {out / 'timings' / fname}: {len(doc['records'])} buckets, {size / 1024:.0f} KiB")
    if part is None and not args.no_install:
        dump_document(doc, args.data_dir / fname)
        shipped.clear_cache()
        _say(f"installed {args.data_dir / fname}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
