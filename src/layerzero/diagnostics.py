"""``lz.doctor()`` / ``layerzero doctor``: what this machine is and what LayerZero will do on it."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import torch

from layerzero.core import config as _config
from layerzero.core import shipped as _shipped
from layerzero.core.device import DeviceSpec
from layerzero.core.runtime import RUNTIME


@dataclass(frozen=True)
class Table:
    """A titled table of strings, rendered with rich when installed, else as aligned plain text."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def plain(self) -> str:
        """Aligned plain-text rendering."""
        cells = [self.columns, *self.rows]
        widths = [min(60, max(len(r[i]) for r in cells)) for i in range(len(self.columns))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [self.title, fmt.format(*self.columns), "  ".join("-" * w for w in widths)]
        lines += [fmt.format(*r) for r in self.rows]
        return "\n".join(lines)

    def rich(self) -> Any:
        """A ``rich.table.Table`` (raises ImportError without rich)."""
        from rich.table import Table as RichTable

        t = RichTable(title=self.title, title_justify="left")
        for c in self.columns:
            t.add_column(c, overflow="fold")
        for r in self.rows:
            t.add_row(*r)
        return t


def print_tables(tables: list[Table], file: Any = None) -> None:
    """Print tables with rich when it is installed (and output is a terminal or a file), else plain text."""
    out = file or sys.stdout
    try:
        from rich.console import Console
    except ImportError:
        for t in tables:
            print(t.plain() + "\n", file=out)
        return
    console = Console(file=out, width=max(120, Console(file=out).width))
    for t in tables:
        console.print(t.rich())


@dataclass(frozen=True)
class DoctorReport:
    """Everything ``doctor`` found; ``tables()`` for display, ``to_dict()`` for JSON."""

    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return self.data

    def to_json(self) -> str:
        """Indented JSON."""
        return json.dumps(self.data, indent=2, sort_keys=True, default=str)

    def tables(self) -> list[Table]:
        """The report as tables: environment, backends, kernels per op, state."""
        d = self.data
        env = Table("Environment", ("item", "value"), tuple((k, str(v)) for k, v in d["environment"].items()))
        backends = Table(
            "Backends",
            ("backend", "available", "version", "reasons"),
            tuple(
                (b["backend"], "yes" if b["available"] else "NO", str(b["version"]), "; ".join(b["reasons"]))
                for b in d["backends"]
            ),
        )
        ops = Table(
            "Kernels by op (eligible on this device type marked *)",
            ("op", "kernels"),
            tuple((op, ", ".join(ks)) for op, ks in d["kernels"].items()),
        )
        state = Table("State", ("item", "value"), tuple((k, str(v)) for k, v in d["state"].items()))
        return [env, backends, ops, state]

    def __str__(self) -> str:
        return "\n\n".join(t.plain() for t in self.tables())


def _shipped_state(device: DeviceSpec, cfg: _config.Config) -> str:
    """Which shipped timing files this device uses, and why the others are ignored (reads them once)."""
    if not cfg.use_shipped_timings:
        return "off (use_shipped_timings=False / LAYERZERO_SHIPPED_TIMINGS=0)"
    states = _shipped.describe(device, cfg.shipped_timings_dir)
    return "; ".join(f"{name}: {why}" for name, why in states) or "no data files"


def collect() -> DoctorReport:
    """Gather the doctor report (loads backends; runs no kernel)."""
    RUNTIME.ensure_ready()
    reg = RUNTIME.registry
    device = DeviceSpec.detect("cuda" if torch.cuda.is_available() else "cpu")
    environment = {
        "device": str(device),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda available": torch.cuda.is_available(),
        "gpu generation": device.generation.name,
        "cpu isa": ", ".join(sorted(device.cpu_isa)) or "unknown",
    }
    backends = [
        {
            "backend": b.backend_id,
            "available": b.available,
            "version": b.version,
            "reasons": [str(r) for r in b.reasons],
        }
        for b in reg.backends.values()
    ]
    kernels: dict[str, list[str]] = {}
    for op in reg.ops:
        kernels[op] = [
            s.kernel_id + ("*" if device.device_type in s.device_types else "")
            for s in sorted(reg.for_op(op), key=lambda s: -s.priority)
        ]
    cfg = _config.get_config()
    policy = _config.effective_policy()
    db = RUNTIME.perfdb()
    stats = RUNTIME.cache.stats()
    state = {
        "config": cfg.to_dict(),
        "policy hash": policy.hash[:16],
        "locks (lz.lock)": _config.get_locks() or "none",
        "policy locks": [f"{r.op}={r.kernel}" for r in policy.locks] or "none",
        "health": RUNTIME.health.snapshot() or "all backends healthy",
        "perfdb": f"{db.path} ({len(db)} rows)" if db is not None else "disabled",
        "quarantine (canaries)": _quarantine_state(),
        "shipped timings": _shipped_state(device, cfg),
        "selection cache": f"{stats.size} entries, {stats.hits} hits, {stats.misses} misses, "
        f"generation {stats.generation}",
    }
    return DoctorReport(
        {"environment": environment, "backends": backends, "kernels": kernels, "state": state}
    )


def _quarantine_state() -> list[str] | str:
    store = RUNTIME.quarantine()
    if store is None:
        return "unavailable (PerfDB off)"
    return [str(e) for e in store.entries()] or "empty"


def run_doctor(print_report: bool = True) -> DoctorReport:
    """Collect the report and (by default) print it as tables."""
    report = collect()
    if print_report:
        print_tables(report.tables())
    return report
