"""SelectionReport: every candidate of one selection with its status, reasons and score breakdown.

``print(report)`` gives a readable table; ``report.to_dict()`` a JSON-ready dict (reasons inside it
round-trip through :meth:`Reason.from_dict`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from .context import SelectionContext
from .reasons import Reason


class CandidateStatus(str, enum.Enum):
    """What happened to a candidate kernel in one selection."""

    SELECTED = "selected"
    ELIGIBLE = "eligible"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class Score:
    """Score = priority + policy boost + PerfDB measurement + shipped measurement - transform cost (higher
    wins).

    ``perf`` comes from the user's PerfDB; ``shipped`` from the timing data shipped for this device model
    (``core/shipped.py``), and is non-zero only when the PerfDB has nothing for the context's bucket.
    """

    priority: float = 0.0
    boost: float = 0.0
    perf: float = 0.0
    transform_cost: float = 0.0
    shipped: float = 0.0

    @property
    def total(self) -> float:
        """The sum that ranks candidates."""
        return self.priority + self.boost + self.perf + self.shipped - self.transform_cost

    def to_dict(self) -> dict[str, float]:
        """JSON-ready breakdown including ``total``."""
        return {
            "priority": self.priority,
            "boost": self.boost,
            "perf": self.perf,
            "shipped": self.shipped,
            "transform_cost": self.transform_cost,
            "total": self.total,
        }


@dataclass(frozen=True, slots=True)
class CandidateReport:
    """One kernel's fate: status, all reasons it was rejected (empty if eligible), score, transforms, and the
    medians (µs) measurements gave it: ``measured_us`` from the PerfDB, ``shipped_us`` from shipped
    timings."""

    kernel_id: str
    status: CandidateStatus
    reasons: tuple[Reason, ...] = ()
    score: Score | None = None
    transforms: tuple[str, ...] = ()
    measured_us: float | None = None
    shipped_us: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "kernel_id": self.kernel_id,
            "status": self.status.value,
            "reasons": [r.to_dict() for r in self.reasons],
            "score": None if self.score is None else self.score.to_dict(),
            "transforms": list(self.transforms),
            "measured_us": self.measured_us,
            "shipped_us": self.shipped_us,
        }


@dataclass(frozen=True, slots=True)
class SelectionReport:
    """The explanation of one selection: context, chosen kernel, every candidate, lock and fallback notes, and
    where shipped timings came from (``shipped_source``: data file, exact or nearest bucket; None if
    unused)."""

    op: str
    context: SelectionContext
    chosen: str | None
    candidates: tuple[CandidateReport, ...]
    locked: str | None = None
    policy_hash: str = ""
    notes: tuple[str, ...] = field(default=())
    shipped_source: str | None = None

    @property
    def fell_back(self) -> bool:
        """True when a preferred or faster kernel could not run and another was chosen (see ``notes``)."""
        return any(n.startswith("fallback") for n in self.notes)

    def candidate(self, kernel_id: str) -> CandidateReport:
        """The entry of ``kernel_id`` (KeyError if it was not a candidate)."""
        for c in self.candidates:
            if c.kernel_id == kernel_id:
                return c
        raise KeyError(kernel_id)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: op, chosen, locked, policy hash, notes, shipped source, context fields,
        candidates."""
        return {
            "op": self.op,
            "chosen": self.chosen,
            "locked": self.locked,
            "policy_hash": self.policy_hash,
            "notes": list(self.notes),
            "shipped_source": self.shipped_source,
            "context": self.context.fields(),
            "device": str(self.context.device),
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def to_json(self) -> str:
        """``to_dict()`` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(kernel, status, score, shipped, reasons) rows in display order: selected, eligible by score,
        rejected. ``shipped`` is the shipped-timings term and median, e.g. ``+812.5 (12.3 us)``, or empty."""
        order = {CandidateStatus.SELECTED: 0, CandidateStatus.ELIGIBLE: 1, CandidateStatus.REJECTED: 2}
        ranked = sorted(
            self.candidates, key=lambda c: (order[c.status], -(c.score.total if c.score else float("-inf")))
        )
        out = []
        for c in ranked:
            score = "" if c.score is None else f"{c.score.total:.1f}"
            shipped = (
                ""
                if c.shipped_us is None or c.score is None
                else (f"+{c.score.shipped:.1f} ({c.shipped_us:.1f} us)")
            )
            detail = "; ".join(str(r) for r in c.reasons)
            if c.transforms:
                detail = (detail + "; " if detail else "") + "transforms: " + ", ".join(c.transforms)
            if c.measured_us is not None:
                detail = (detail + "; " if detail else "") + f"measured {c.measured_us:.1f} us"
            out.append((c.kernel_id, c.status.value, score, shipped, detail))
        return out

    def __str__(self) -> str:
        ctx = {k: v for k, v in self.context.fields().items() if v not in (None, False)}
        head = [
            f"LayerZero selection for op {self.op!r}: chosen {self.chosen}",
            f"device: {self.context.device}",
            "context: " + ", ".join(f"{k}={v}" for k, v in ctx.items()),
        ]
        if self.locked:
            head.append(f"locked to: {self.locked}")
        if self.shipped_source:
            head.append(f"shipped timings: {self.shipped_source}")
        head += [f"note: {n}" for n in self.notes]
        rows = [("kernel", "status", "score", "shipped", "reasons / details"), *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:<{widths[3]}}  "
            f"{r[4]}".rstrip()
            for r in rows
        ]
        lines.insert(1, "-" * (sum(widths) + 8 + max(len(r[4]) for r in rows)))
        return "\n".join(head + lines)

    def __rich__(self) -> Any:
        """A rich Table (used by the CLI when rich is installed)."""
        from rich.table import Table

        table = Table(title=f"{self.op}: chosen {self.chosen}", caption=str(self.context.device))
        for col in ("kernel", "status", "score", "shipped", "reasons / details"):
            table.add_column(col, overflow="fold")
        style = {"selected": "bold green", "eligible": "cyan", "rejected": "dim"}
        for row in self.rows():
            table.add_row(*row, style=style[row[1]])
        return table
