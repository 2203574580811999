"""Plot a sweep.csv (from benchmarks/sweep.py) into sweep.png: pick / fastest per shape, pick / SDPA default
per shape (both modes), and paged-decode bandwidth against the copy bandwidth.

Needs matplotlib (not a LayerZero dependency; run it on any machine after the sweep)::

    PYTHONPATH=src python benchmarks/plot_sweep.py benchmarks/results/h200_sweep/sweep.csv [--out sweep.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sweep_report import TARGETS, read_csv, summarize  # noqa: E402

__all__ = ["main", "plot"]


def plot(csv_path: Path, out: Path) -> Path:
    """Write the figure for ``csv_path`` to ``out`` (PNG) and return ``out``.

    Panels: (1) fastest / pick per shape, default and tuned picks, with the 0.97 / 0.85 lines; (2) pick /
    SDPA default (kernel time) per shape, with the 1.03 line; (3) paged decode achieved GB/s (KV bytes read /
    pick time) and copy GB/s per shape, batch on the x labels.

    Raises:
        ImportError: matplotlib is not installed. FileNotFoundError: no such CSV.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_csv(csv_path)
    default, tuned = summarize(rows, "default"), {s["shape_id"]: s for s in summarize(rows, "tuned")}
    x = list(range(len(default)))
    labels = [s["label"] for s in default]
    fig, axes = plt.subplots(3, 1, figsize=(max(10, 0.28 * len(x) + 4), 14))
    ax = axes[0]
    ax.scatter(
        x,
        [s["ratio"] if s["ratio"] is not None else float("nan") for s in default],
        label="default pick",
        marker="o",
    )
    ax.scatter(
        x,
        [tuned.get(s["shape_id"], {}).get("ratio") or float("nan") for s in default],
        label="tuned pick",
        marker="x",
    )
    ax.axhline(TARGETS["geomean"], ls="--", c="g", lw=0.8, label=f"geomean target {TARGETS['geomean']}")
    ax.axhline(TARGETS["worst"], ls=":", c="r", lw=0.8, label=f"worst target {TARGETS['worst']}")
    ax.set_ylabel("fastest / pick (kernel time)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.scatter(
        x,
        [s["sdpa_ratio"] if s["sdpa_ratio"] is not None else float("nan") for s in default],
        label="default pick",
        marker="o",
    )
    ax.scatter(
        x,
        [tuned.get(s["shape_id"], {}).get("sdpa_ratio") or float("nan") for s in default],
        label="tuned pick",
        marker="x",
    )
    ax.axhline(TARGETS["sdpa_slowdown"], ls="--", c="r", lw=0.8, label=f"limit {TARGETS['sdpa_slowdown']}")
    ax.set_ylabel("pick / SDPA default (kernel time)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    for a in axes[:2]:
        a.set_xticks(x)
        a.set_xticklabels(labels, rotation=90, fontsize=6)
    ax = axes[2]
    dec = [s for s in default if s["phase"] == "paged_decode" and s["gbps"] is not None]
    xs = list(range(len(dec)))
    ax.bar(
        [i - 0.2 for i in xs],
        [s["gbps"] for s in dec],
        width=0.4,
        label="paged decode pick (KV bytes / time)",
    )
    ax.bar([i + 0.2 for i in xs], [s["copy_gbps"] or 0 for s in dec], width=0.4, label="copy (read + write)")
    ax.set_xticks(xs)
    ax.set_xticklabels([s["label"] for s in dec], rotation=90, fontsize=6)
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: ``plot_sweep.py CSV [--out PNG]`` (default: sweep.png next to the CSV)."""
    p = argparse.ArgumentParser(description="Plot a LayerZero sweep.csv into a PNG.")
    p.add_argument("csv", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = plot(args.csv, args.out or args.csv.with_name("sweep.png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
