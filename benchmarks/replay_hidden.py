"""Replay a recorded hidden-shape check under this checkout's selection rule, on any machine, with no GPU.

``hidden_shapes.py`` records every eligible kernel's median for each hidden shape (``hidden_shapes.csv``). The
default pick is a function of the shipped timing file, the hand priorities and the scoring rule only, so a
change to the rule (e.g. ``OperationSpec.shipped_tie_margin``) can be judged against the recorded medians
before spending GPU time:

1. each shape's :class:`SelectionContext` is rebuilt from its seeded case on the CPU (the same lengths, block
   tables and buckets as on the GPU) and moved to a fake device carrying the data file's fingerprint;
2. :func:`layerzero.core.shipped.lookup` finds its shipped record, exactly as selection does;
3. the pick is the kernel with the highest ``priority + ShippedMatch.score(kid, perf_weight, margin)`` among
   the kernels the CSV timed for the shape (policy boosts and transform costs are 0 in the check);
4. ratio = fastest recorded median / the pick's recorded median, and the targets of ``hidden_shapes.py``.

With ``--margin 0`` the replay must reproduce the recorded default picks (it says how many it did): that is
the check that the replay models selection. The GPU run stays the acceptance test.

Usage::

    PYTHONPATH=src python benchmarks/replay_hidden.py \\
        --csv benchmarks/results/ship_timings/nvidia-h200/hidden_shapes.csv \\
        --timings src/layerzero/data/timings/nvidia-h200.json  # each op's margin; --margin 0.1: one for all
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ship_grid import build  # noqa: E402
from hidden_shapes import TARGETS, cpu_hidden_cases, hidden_cases  # noqa: E402

import layerzero as lz  # noqa: E402
from layerzero.core import shipped  # noqa: E402
from layerzero.core.device import DeviceSpec  # noqa: E402
from layerzero.core.runtime import RUNTIME  # noqa: E402
from layerzero.testing.devices import fake_cuda_device  # noqa: E402

__all__ = ["main", "replay"]


def _recorded(csv_path: Path) -> dict[int, dict[str, object]]:
    """shape index -> {"label", "medians": {kid: µs}, "default": kid}."""
    out: dict[int, dict[str, object]] = defaultdict(lambda: {"medians": {}, "default": None})
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            rec = out[int(row["shape"])]
            rec["label"] = row["label"]
            if row["status"] == "ok" and row["median_us"]:
                rec["medians"][row["kernel_id"]] = float(row["median_us"])  # type: ignore[index]
            if row["is_default"] == "True":
                rec["default"] = row["kernel_id"]
    return dict(out)


def replay(
    csv_path: Path, timings: Path, margin: float | None, kinds: tuple[str, ...] | None = None
) -> list[dict[str, object]]:
    """One row per recorded shape (of ``kinds`` only, when given: ``"prefill"``, ``"paged_decode"``, ...):
    label, recorded default, replayed pick, its ratio and the shipped source."""
    doc = json.loads(timings.read_text())
    cpu = doc["fingerprint"].get("device_type") == "cpu"
    if cpu:
        device = DeviceSpec.detect("cpu")
    else:
        sm = tuple(int(x) for x in doc["fingerprint"].get("sm", "9.0").split("."))
        device = fake_cuda_device(sm, name=doc["fingerprint"].get("name", "GPU"))
    RUNTIME.ensure_ready()
    reg = RUNTIME.registry
    file_versions = doc["backends"]
    doc["fingerprint"] = shipped.device_fingerprint(
        device
    )  # this process's torch / cuDNN: match by construction
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / timings.name).write_text(json.dumps(doc))
        shipped.clear_cache()

        def version(kid: str) -> tuple[str, str | None] | None:
            backend = kid.split(".", 1)[0]
            return backend, file_versions.get(backend)

        recorded = _recorded(csv_path)
        cases = cpu_hidden_cases() if cpu else hidden_cases()
        for index, case in enumerate(cases):
            rec = recorded.get(index)
            if rec is None or rec["label"] != case.label() or (kinds is not None and case.kind not in kinds):
                continue
            args, kwargs = build(case, torch.device("cpu"), values=False)  # selection reads no values
            ctx = dataclasses.replace(lz.explain(case.op, *args, **kwargs).context, device=device)
            match = shipped.lookup(ctx, version, tmp)
            medians: dict[str, float] = rec["medians"]  # type: ignore[assignment]

            m = reg.ops.get(case.op).shipped_tie_margin if margin is None else margin
            weight = lz.get_config().perf_weight
            scores = {
                kid: float(reg.kernels.get(kid).priority)
                + (0.0 if match is None else match.score(kid, weight, m))
                for kid in medians
            }
            pick = max(scores, key=scores.__getitem__)
            fastest = min(medians.values())
            rows.append(
                {
                    "label": case.label(),
                    "recorded": rec["default"],
                    "pick": pick,
                    "ratio": fastest / medians[pick],
                    "source": None if match is None else match.source,
                }
            )
        shipped.clear_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, required=True, help="a hidden_shapes.csv of a GPU run")
    ap.add_argument("--timings", type=Path, required=True, help="the shipped timing file that run used")
    ap.add_argument(
        "--margin",
        type=float,
        default=None,
        help="one shipped_tie_margin for every op (default: each op's own, as selection does)",
    )
    a = ap.parse_args(argv)
    rows = replay(a.csv, a.timings, a.margin)
    same = sum(r["pick"] == r["recorded"] for r in rows)
    for r in rows:
        flag = "" if r["pick"] == r["recorded"] else f"   (recorded {r['recorded']})"
        print(f"{r['ratio']:.3f}  {r['pick']:<28} {r['label']}{flag}")
    ratios = [float(r["ratio"]) for r in rows]
    geo = math.exp(sum(math.log(max(x, 1e-9)) for x in ratios) / len(ratios))
    worst = min(rows, key=lambda r: r["ratio"])
    lo_geo, lo_min = TARGETS["default"]
    verdict = "PASS" if geo >= lo_geo and worst["ratio"] >= lo_min else "FAIL"
    print(
        f"{verdict}  margin {'per op' if a.margin is None else a.margin}: {len(rows)} shapes, geomean "
        f"{geo:.3f}, min {worst['ratio']:.3f} ({worst['label']}); {same}/{len(rows)} picks equal the "
        "recorded defaults"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
