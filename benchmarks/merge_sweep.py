"""Merge sweep runs made in several device calls (one call is limited to 10 minutes) into one result set.

Each ``--run DIR[:PHASES]`` is a ``sweep.py --out`` directory; only the rows of the listed phases
(comma-separated, default all) are taken, shape ids are offset by 1000 per run so they stay unique, and the
targets are recomputed over the union. Writes sweep.csv, sweep.md and env.json (with every run's command) into
``--out``.

    python benchmarks/merge_sweep.py --out benchmarks/results/h200_sweep \\
        --run /work/.device/7/sweep:prefill,decode --run /work/.device/8/sweep:paged_decode \\
        --run /work/.device/9/sweep:paged_append
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sweep_measure import COLUMNS  # noqa: E402
from _sweep_report import compute_targets, read_csv, write_csv, write_env, write_markdown  # noqa: E402
from _sweep_shapes import full_shapes  # noqa: E402


def merge(runs: list[tuple[Path, set[str] | None]], out: Path) -> dict:
    """Merge ``runs`` (directory, phases or None for all) into ``out``; returns the merged env.json dict."""
    rows, commands, env, done, tuned, elapsed = [], [], None, 0, 0, 0.0
    for i, (d, phases) in enumerate(runs):
        meta = json.loads((d / "env.json").read_text())
        env = env or {k: v for k, v in meta.items() if k not in ("run", "targets")}
        run = meta["run"]
        taken = [r for r in read_csv(d / "sweep.csv") if phases is None or r["phase"] in phases]
        for r in taken:
            r["shape_id"] = str(1000 * i + int(r["shape_id"]))
        rows += taken
        commands.append(run["command"] + (f"  [phases {','.join(sorted(phases))}]" if phases else ""))
        done += len({r["shape_id"] for r in taken})
        tuned += len({r["shape_id"] for r in taken if r.get("tuned_by")})
        elapsed += run["elapsed_s"]
    meta = {
        "command": " ; ".join(commands),
        "shapes_planned": len(full_shapes()),
        "shapes_done": done,
        "shapes_tuned": tuned,
        "elapsed_s": elapsed,
        "budget_s": elapsed,
        "runs": len(runs),
    }
    targets = compute_targets(rows)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "sweep.csv", rows, COLUMNS)
    write_markdown(out / "sweep.md", rows, targets, env, meta)
    write_env(out / "env.json", env, meta, targets)
    return {"targets": targets, "shapes": done}


def main() -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--run", action="append", required=True, help="DIR or DIR:phase1,phase2")
    a = ap.parse_args()
    runs = []
    for spec in a.run:
        d, _, phases = spec.partition(":")
        runs.append((Path(d), set(phases.split(",")) if phases else None))
    res = merge(runs, a.out)
    for t in res["targets"]:
        print(f"{t.verdict():<4} [{t.mode}] {t.name}: {t.value} ({t.detail})")
    print(f"{res['shapes']} shapes -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
