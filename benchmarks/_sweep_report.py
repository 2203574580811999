"""Outputs of the H200 sweep: per-shape summaries, the targets (PASS/FAIL), sweep.csv, sweep.md, env.json.

Every function here is pure over the rows (dicts with the :data:`_sweep_measure.COLUMNS` keys, as measured or
as read back from sweep.csv, where every value is a string), so the target math can be checked on a
hand-worked table.
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import math
import platform
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _sweep_shapes import Shape

from layerzero.core.device import DeviceSpec

__all__ = [
    "TARGETS",
    "Target",
    "collect_env",
    "compute_targets",
    "read_csv",
    "summarize",
    "write_csv",
    "write_env",
    "write_markdown",
]

MODES = ("default", "tuned")
TARGETS = {"geomean": 0.97, "worst": 0.85, "sdpa_slowdown": 1.03, "decode_bw": 0.80, "decode_bw_batch": 64}
"""pick/fastest geomean and worst minimum; largest allowed pick/SDPA-default kernel-time ratio; paged decode
at B >= ``decode_bw_batch``: smallest achieved/copy bandwidth ratio."""


def _f(x: Any) -> float | None:
    """A float from a row value ('' / None / non-finite -> None)."""
    if x is None or x == "":
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _b(x: Any) -> bool:
    return x is True or str(x).strip().lower() in ("true", "1")


def summarize(rows: Iterable[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """One summary per shape for ``mode`` (``default``: pass-1 times and ``is_pick_default``; ``tuned``:
    pass-2 times and ``is_pick_tuned``; shapes without pass-2 times are left out of ``tuned``).

    Keys: shape_id, label, phase, B, fastest (kernel id), fastest_us, pick, pick_us, ratio (fastest_us /
    pick_us; 0.0 when the pick failed its check or raised, None when it was not timed), sdpa_us, sdpa_ratio
    (pick_us / sdpa_us, eager), graph_sdpa_ratio (the same from CUDA-graph replays of both, when both are
    graph-safe), lz_call_us, overhead_us (lz_call_us - pick_us), gbps (KV bytes / pick time, GB/s), copy_gbps,
    bw_ratio (gbps / copy_gbps), sdpa_kernel (the sub-backend SDPA's default runs; '' when unknown),
    same_as_sdpa (the pick is that sub-backend: the same kernel, so pick vs SDPA differs only by host time and
    noise), graph_kernel / graph_gbps / graph_bw_ratio (the lz call replayed from a CUDA graph, paged decode
    at B >= 64, vs the eager copy; None elsewhere). Times in µs.
    """
    col = "median_us" if mode == "default" else "tuned_median_us"
    pick_col = "is_pick_default" if mode == "default" else "is_pick_tuned"
    shapes: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        shapes.setdefault(str(r["shape_id"]), []).append(r)
    out = []
    for sid, rs in shapes.items():
        first = rs[0]
        kernels = [r for r in rs if r["row_kind"] == "kernel"]
        timed = [r for r in kernels if r["status"] == "ok" and _b(r["correct"]) and _f(r[col]) is not None]
        if mode == "tuned" and not any(_f(r[col]) is not None for r in rs):
            continue
        fastest = min(timed, key=lambda r: _f(r[col])) if timed else None
        pick = next((r for r in kernels if _b(r[pick_col])), None)
        pick_us = _f(pick[col]) if pick is not None and pick["status"] == "ok" else None
        fastest_us = _f(fastest[col]) if fastest else None
        ratio = None
        if pick is not None and pick["status"] in ("incorrect", "error"):
            ratio = 0.0
        elif pick_us and fastest_us is not None:
            ratio = fastest_us / pick_us
        sdpa = next((r for r in rs if _b(r["is_sdpa_default"]) and r["status"] == "ok"), None)
        sdpa_us = _f(sdpa[col]) if sdpa else None
        lz_call = next((r for r in rs if r["row_kind"] == "lz_call"), None)
        lz_us = _f(lz_call[col]) if lz_call else None
        copy = next((r for r in rs if r["row_kind"] == "copy"), None)
        copy_us = _f(copy[col]) if copy else None
        kv = _f(first["kv_bytes"]) or 0.0
        g_lz = next((r for r in rs if r["row_kind"] == "lz_graph" and r["status"] == "ok"), None)
        g_lz_us = _f(g_lz[col]) if g_lz else None
        graph_gbps = kv / (g_lz_us * 1e-6) / 1e9 if g_lz_us else None
        graph_kernel = None
        if g_lz is not None:
            part = str(g_lz["detail"]).split(" | tuned pass: ")[-1 if mode == "tuned" else 0]
            graph_kernel = part.split("ran ")[-1] if "ran " in part else None
        sdpa_kernel = str((sdpa or {}).get("sdpa_kernel") or "")
        gcol = "graph_us" if mode == "default" else "tuned_graph_us"
        pick_g = _f(pick.get(gcol)) if pick is not None and pick["status"] == "ok" else None
        sdpa_g = _f(sdpa.get(gcol)) if sdpa else None
        graph_sdpa_ratio = pick_g / sdpa_g if pick_g and sdpa_g else None
        gbps = kv / (pick_us * 1e-6) / 1e9 if pick_us and first["phase"] == "paged_decode" else None
        copy_gbps = 2 * kv / (copy_us * 1e-6) / 1e9 if copy_us else None
        out.append(
            {
                "shape_id": sid,
                "phase": first["phase"],
                "B": int(first["B"]),
                "label": Shape.from_row(first).label(),
                "fastest": fastest["kernel_id"] if fastest else None,
                "fastest_us": fastest_us,
                "pick": pick["kernel_id"] if pick else None,
                "pick_us": pick_us,
                "ratio": ratio,
                "sdpa_us": sdpa_us,
                "sdpa_ratio": pick_us / sdpa_us if pick_us and sdpa_us else None,
                "graph_sdpa_ratio": graph_sdpa_ratio,
                "lz_call_us": lz_us,
                "overhead_us": lz_us - pick_us if lz_us is not None and pick_us else None,
                "gbps": gbps,
                "copy_gbps": copy_gbps,
                "bw_ratio": gbps / copy_gbps if gbps is not None and copy_gbps else None,
                "sdpa_kernel": sdpa_kernel,
                "same_as_sdpa": bool(pick) and pick["kernel_id"] == sdpa_kernel,
                "graph_kernel": graph_kernel,
                "graph_gbps": graph_gbps,
                "graph_bw_ratio": graph_gbps / copy_gbps if graph_gbps and copy_gbps else None,
            }
        )
    return out


@dataclass(frozen=True, slots=True)
class Target:
    """One target of one mode: ``passed`` None = not applicable (no shape measured it) or informational."""

    name: str
    mode: str
    value: float | None
    threshold: str
    passed: bool | None
    detail: str

    def verdict(self) -> str:
        """``PASS`` / ``FAIL`` / ``n/a`` / ``info``."""
        if self.passed is None:
            return "info" if self.threshold == "" else "n/a"
        return "PASS" if self.passed else "FAIL"


def _geomean(xs: list[float]) -> float:
    return 0.0 if any(x <= 0 for x in xs) else math.exp(sum(math.log(x) for x in xs) / len(xs))


def _sdpa_targets(sums: list[dict[str, Any]], mode: str) -> list[Target]:
    name, limit = "pick / SDPA default (bare kernel, eager), max", TARGETS["sdpa_slowdown"]
    other = [s for s in sums if s["sdpa_ratio"] is not None and not s["same_as_sdpa"]]
    same = [s for s in sums if s["sdpa_ratio"] is not None and s["same_as_sdpa"]]
    out = []
    if other:
        worst = max(other, key=lambda s: s["sdpa_ratio"])
        nfail = sum(s["sdpa_ratio"] > limit for s in other)
        out.append(
            Target(
                name,
                mode,
                worst["sdpa_ratio"],
                f"<= {limit}",
                worst["sdpa_ratio"] <= limit,
                f"at {worst['label']} ({worst['pick']}); {nfail} of {len(other)} shapes (pick is another "
                f"kernel than SDPA's) over",
            )
        )
    else:
        out.append(
            Target(
                name, mode, None, f"<= {limit}", None, "no shape where the pick differs from SDPA's kernel"
            )
        )
    if same:
        worst = max(same, key=lambda s: s["sdpa_ratio"])
        out.append(
            Target(
                "pick / SDPA default where the pick IS SDPA's kernel",
                mode,
                worst["sdpa_ratio"],
                "",
                None,
                f"{len(same)} shapes; max at {worst['label']} ({worst['pick']}): same kernel, the ratio is "
                f"host time + noise",
            )
        )
    graphed = [s for s in other if s["graph_sdpa_ratio"] is not None]
    if graphed:
        worst = max(graphed, key=lambda s: s["graph_sdpa_ratio"])
        out.append(
            Target(
                "pick / SDPA default, CUDA-graph kernel time, max",
                mode,
                worst["graph_sdpa_ratio"],
                "",
                None,
                f"at {worst['label']} ({worst['pick']}); {len(graphed)} shapes where the pick is "
                f"another graph-safe kernel than SDPA's",
            )
        )
    return out


def _bandwidth_targets(sums: list[dict[str, Any]], mode: str) -> list[Target]:
    b = TARGETS["decode_bw_batch"]
    big = [s for s in sums if s["phase"] == "paged_decode" and s["B"] >= b]
    out = []
    for key, name, judged in (
        ("graph_bw_ratio", f"paged decode B>={b} (CUDA graph): GB/s / copy GB/s, min", True),
        ("bw_ratio", f"paged decode B>={b} (eager calls): GB/s / copy GB/s, min", False),
    ):
        gk, ck = ("graph_gbps" if judged else "gbps"), "copy_gbps"
        bw = [
            (s[key], s["label"], s[gk], s[ck], s["graph_kernel"] if judged else s["pick"])
            for s in big
            if s[key] is not None
        ]
        threshold = f">= {TARGETS['decode_bw']}" if judged else ""
        if bw:
            low, where, g, c, kid = min(bw)
            out.append(
                Target(
                    name,
                    mode,
                    low,
                    threshold,
                    (low >= TARGETS["decode_bw"]) if judged else None,
                    f"at {where} ({kid}): {g:.0f} GB/s vs copy {c:.0f} GB/s; {len(bw)} shapes",
                )
            )
        else:
            out.append(Target(name, mode, None, threshold, None, "no paged decode shape at that batch"))
    return out


def compute_targets(rows: list[dict[str, Any]]) -> list[Target]:
    """The targets of the issue for both modes, computed from the rows (see :func:`summarize`):

    - pick / fastest correct kernel: geomean >= 0.97 and worst >= 0.85 (a pick that failed its check counts
      0; a shape whose pick was not timed makes the target FAIL);
    - pick never more than 3% slower than SDPA's default (kernel time): max pick_us / sdpa_us <= 1.03 over the
      shapes where the pick is another kernel than the one SDPA runs (``same_as_sdpa`` False); where it is the
      same kernel the ratio only measures host time and noise, and is reported as info;
    - paged decode at B >= 64: min achieved GB/s (KV bytes read / time) / copy GB/s (read + write bytes / copy
      time, measured in the same run, eager) >= 0.80, with the lz call replayed from a CUDA graph (kernel
      bandwidth, as served: decode steps run as graphs); the same ratio from eager calls (host launch time
      included, which dominates below ~50 µs) is reported as info;
    - informational: the lz call's dispatch overhead (median and max µs over the kernel it runs).
    """
    out = []
    for mode in MODES:
        sums = summarize(rows, mode)
        missing = [s["label"] for s in sums if s["ratio"] is None]
        ratios = [(s["ratio"], s["label"]) for s in sums if s["ratio"] is not None]
        note = f"; {len(missing)} shape(s) without a timed pick: {missing[:3]}" if missing else ""
        if ratios:
            gm = _geomean([r for r, _ in ratios])
            worst, where = min(ratios)
            out.append(
                Target(
                    "pick / fastest, geomean",
                    mode,
                    gm,
                    f">= {TARGETS['geomean']}",
                    gm >= TARGETS["geomean"] and not missing,
                    f"{len(ratios)} shapes{note}",
                )
            )
            out.append(
                Target(
                    "pick / fastest, worst",
                    mode,
                    worst,
                    f">= {TARGETS['worst']}",
                    worst >= TARGETS["worst"] and not missing,
                    f"at {where}{note}",
                )
            )
        else:
            for name, key in (("pick / fastest, geomean", "geomean"), ("pick / fastest, worst", "worst")):
                out.append(Target(name, mode, None, f">= {TARGETS[key]}", None, "no shape measured" + note))
        out += _sdpa_targets(sums, mode) + _bandwidth_targets(sums, mode)
        ov = sorted(s["overhead_us"] for s in sums if s["overhead_us"] is not None)
        if ov:
            out.append(
                Target(
                    "lz call - pick kernel (dispatch overhead, µs), median",
                    mode,
                    ov[len(ov) // 2],
                    "",
                    None,
                    f"max {ov[-1]:.1f} µs over {len(ov)} shapes (end-to-end call vs bare kernel)",
                )
            )
    return out


def write_csv(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """sweep.csv: one row per shape x callable, ``columns`` in order (private ``_`` keys dropped)."""
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a sweep.csv (every value a string)."""
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def open_device(name: str, tool: str, cpu_threads: int | None) -> torch.device | None:
    """The benchmark's device, or None (after saying why on stderr) when it names CUDA and CUDA is not
    available. On the CPU ``cpu_threads`` (when given) sets torch's thread count: one thread is far less noisy
    on a shared machine."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"{tool}: --device cuda but CUDA is not available; use --device cpu --quick for the CPU smoke "
            "test",
            file=sys.stderr,
            flush=True,
        )
        return None
    if device.type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    return device


def collect_env(device: torch.device) -> dict[str, Any]:
    """Machine and versions: GPU name, SM, driver, CUDA, torch, cuDNN, Triton, flashinfer, flash-attn,
    xformers, Python, LayerZero, date (UTC ISO 8601)."""
    spec = DeviceSpec.detect(device)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": spec.name,
        "sm": ".".join(map(str, spec.sm)) if spec.sm else None,
        "gpu_generation": spec.generation.name,
        "memory_gib": round((spec.total_memory_bytes or 0) / 2**30, 1),
        "driver": spec.driver_version,
        "cuda": spec.cuda_version,
        "torch": torch.__version__,
        "cudnn": spec.cudnn_version,
        "triton": _version("triton"),
        "flashinfer": _version("flashinfer-python") or _version("flashinfer"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "xformers": _version("xformers"),
        "python": platform.python_version(),
        "layerzero": _version("layerzero"),
        "host_cpu": platform.processor() or platform.machine(),
    }


def _us(x: float | None) -> str:
    return "—" if x is None else f"{x:,.1f}"


def _r(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def write_markdown(
    path: Path, rows: list[dict[str, Any]], targets: list[Target], env: dict[str, Any], meta: dict[str, Any]
) -> None:
    """sweep.md: machine and versions, the targets, the per-shape table (both modes), and every kernel that
    failed the correctness check, raised or was skipped."""
    lines = [
        "# LayerZero kernel sweep",
        "",
        f"{env['date']} on {env['device_name']} (SM {env['sm']}, {env['memory_gib']} GiB), driver "
        f"{env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, cuDNN {env['cudnn']}, Triton "
        f"{env['triton']}, flashinfer {env['flashinfer']}, flash-attn {env['flash_attn']}, xformers "
        f"{env['xformers']}, Python {env['python']}.",
        "",
        f"Command: `{meta.get('command', '')}`. {meta.get('shapes_done', '?')} of "
        f"{meta.get('shapes_planned', '?')} shapes measured, {meta.get('shapes_tuned', '?')} tuned, in "
        f"{meta.get('elapsed_s', 0):.0f} s (budget {meta.get('budget_s', 0):.0f} s).",
        "",
        "Method: every kernel `lz.explain` lists as eligible is checked on a float64 reference slice "
        "(sequences 0 and B-1, query heads 0 / mid / last; `|out-ref|/(1+|ref|)` within the dtype's "
        "tolerance), then timed bare with the `lz.tune` harness (CUDA events, median of samples after "
        "outlier removal), interleaved in rounds with SDPA's default and the `lz` call. *default*: "
        "LayerZero's pick with an empty PerfDB (priorities only). *tuned*: after `lz.tune` of each shape "
        "into a fresh PerfDB, a separate timing pass. Copy bandwidth counts read + write bytes. *SDPA runs*: "
        "the sub-backend SDPA's default dispatches to (`torch._fused_sdp_choice`); where the pick is that "
        "same kernel, pick vs SDPA is host time and noise. *vs SDPA*: pick (bare kernel) / SDPA default, "
        "eager medians (how both were chosen and are called); the same ratio from CUDA-graph replays of both "
        "(kernel time without host launch time) is reported as info. *graph*: paged decode at B >= 64, the "
        "`lz` call captured 10 times in one CUDA graph and replayed (kernel time without host launch "
        "overhead; it runs the graph-safe kernel selection picks under capture), compared with the eager "
        "copy (captured, a copy runs as a memcpy node at ~2.7 TB/s instead of ~4.2 TB/s).",
        "",
        "## Targets",
        "",
        "| target | mode | value | threshold | verdict | detail |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for t in targets:
        lines.append(
            f"| {t.name} | {t.mode} | {_r(t.value)} | {t.threshold} | **{t.verdict()}** | {t.detail} |"
        )
    tuned = {s["shape_id"]: s for s in summarize(rows, "tuned")}
    lines += [
        "",
        "## Per shape",
        "",
        "Times in µs (median). ratio = fastest / pick; vs SDPA = pick / SDPA default.",
        "",
        "| shape | fastest | µs | pick (default) | ratio | pick (tuned) | ratio | SDPA default µs | "
        "SDPA runs | vs SDPA | lz call µs | GB/s (copy) | graph GB/s, tuned |",
        "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]

    def gb(x: float | None, copy: float | None) -> str:
        return "" if x is None else f"{x:,.3g}" + (f" ({copy:,.3g})" if copy else "")

    for s in summarize(rows, "default"):
        t = tuned.get(s["shape_id"], {})
        graph = gb(t.get("graph_gbps"), None)
        graph += f" {t['graph_kernel']}" if graph and t.get("graph_kernel") else ""
        lines.append(
            f"| {s['label']} | {s['fastest']} | {_us(s['fastest_us'])} | {s['pick']} | {_r(s['ratio'])} | "
            f"{t.get('pick', '—')} | {_r(t.get('ratio'))} | {_us(s['sdpa_us'])} | {s['sdpa_kernel']} | "
            f"{_r(s['sdpa_ratio'])} | {_us(s['lz_call_us'])} | {gb(s['gbps'], s['copy_gbps'])} | {graph} |"
        )
    bad = [r for r in rows if r["status"] in ("incorrect", "error", "skipped") and r["row_kind"] != "lz_call"]
    lines += ["", "## Kernels that failed the check, raised, or were skipped", ""]
    if not bad:
        lines.append("None.")
    else:
        lines += [
            "| shape id | phase | kernel | status | max rel err | detail |",
            "| --- | --- | --- | --- | ---: | --- |",
        ]
        for r in bad:
            err = _f(r["max_rel_err"])
            lines.append(
                f"| {r['shape_id']} | {r['phase']} | {r['kernel_id']} | {r['status']} | "
                f"{'' if err is None else f'{err:.3g}'} | {str(r['detail']).replace('|', '/')} |"
            )
    path.write_text("\n".join(lines) + "\n")


def write_env(path: Path, env: dict[str, Any], meta: dict[str, Any], targets: list[Target]) -> None:
    """env.json: the machine, the run's metadata and the targets."""
    path.write_text(
        json.dumps({**env, "run": meta, "targets": [asdict(t) for t in targets]}, indent=2, default=str)
        + "\n"
    )
