"""TuneReport: what ``lz.tune`` measured, per case and kernel, printable as a table and JSON-ready."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["TuneReport", "TuneRow", "TuneStatus"]


class TuneStatus(str, enum.Enum):
    """What happened to one kernel on one case.

    - ``OK``: matched the reference, timed, and (when the PerfDB is enabled) recorded;
    - ``FAILED_CHECK``: ran but differed from the reference beyond the dtype's tolerance: never timed or
      recorded;
    - ``ERROR``: raised during the check or the timing: not recorded;
    - ``INELIGIBLE``: selection would not consider it for these inputs (constraints, availability, health or
      policy; ``detail`` lists the reasons): not run.
    """

    OK = "ok"
    FAILED_CHECK = "failed-check"
    ERROR = "error"
    INELIGIBLE = "ineligible"


@dataclass(frozen=True, slots=True)
class TuneRow:
    """One kernel on one case.

    Attributes:
        case: index of the case in ``TuneReport.cases``.
        kernel_id: e.g. ``"torch_sdpa.flash"``.
        status: see :class:`TuneStatus`.
        median_us, p95_us, p99_us: statistics of the kept samples, µs per call (``None`` unless ``OK``);
            percentiles by nearest rank (``numpy.percentile(method="inverted_cdf")``).
        samples: kept samples (each the mean of ``iters`` calls).
        outliers: samples dropped as beyond median + 5 x MAD.
        max_error: largest ``|out - ref| / (1 + |ref|)`` against the reference kernel (``None`` if not run).
        detail: the error, the failed check, or the ineligibility reasons; empty when ``OK``.
        recorded: the samples were written to the PerfDB.
        reason_codes: for ``INELIGIBLE`` rows, the reasons' stable codes (the table shows these).
    """

    case: int
    kernel_id: str
    status: TuneStatus
    median_us: float | None = None
    p95_us: float | None = None
    p99_us: float | None = None
    samples: int = 0
    outliers: int = 0
    max_error: float | None = None
    detail: str = ""
    recorded: bool = False
    reason_codes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (status as its string value)."""
        return {
            "case": self.case,
            "kernel_id": self.kernel_id,
            "status": self.status.value,
            "median_us": self.median_us,
            "p95_us": self.p95_us,
            "p99_us": self.p99_us,
            "samples": self.samples,
            "outliers": self.outliers,
            "max_error": self.max_error,
            "detail": self.detail,
            "recorded": self.recorded,
            "reason_codes": list(self.reason_codes),
        }


def _short(row: TuneRow) -> str:
    text = ", ".join(row.reason_codes) if row.reason_codes else row.detail
    return text if len(text) <= 80 else text[:77] + "..."


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


@dataclass(frozen=True, slots=True)
class TuneReport:
    """Everything one ``lz.tune`` call measured.

    Attributes:
        op: the op id.
        cases: one label per case (op, dtype, device and shape bucket, e.g. ``"float32 cpu B=2 Hq=8 ..."``).
        buckets: the PerfDB bucket key of each case (``SelectionContext.bucket_key()``).
        fingerprints: the PerfDB device fingerprint of each case.
        rows: every (case, kernel) outcome, in case then registration order.
        perfdb_path: the PerfDB file written, or ``None`` when the PerfDB is disabled / unusable.
    """

    op: str
    cases: tuple[str, ...]
    buckets: tuple[str, ...]
    fingerprints: tuple[str, ...]
    rows: tuple[TuneRow, ...]
    perfdb_path: str | None = None

    def best(self) -> dict[int, TuneRow]:
        """The fastest ``OK`` row (lowest median) of each case that has one: ``{case index: row}``."""
        out: dict[int, TuneRow] = {}
        for row in self.rows:
            if row.status is TuneStatus.OK and row.median_us is not None:
                cur = out.get(row.case)
                if cur is None or row.median_us < (cur.median_us or 0.0):
                    out[row.case] = row
        return out

    def for_case(self, case: int) -> list[TuneRow]:
        """The rows of case ``case``."""
        return [r for r in self.rows if r.case == case]

    def row(self, case: int, kernel_id: str) -> TuneRow:
        """The row of ``kernel_id`` on ``case``; ``KeyError`` when that kernel was not listed."""
        for r in self.rows:
            if r.case == case and r.kernel_id == kernel_id:
                return r
        raise KeyError(f"no row for kernel {kernel_id!r} on case {case}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: op, cases (label, bucket, fingerprint, best kernel), rows, perfdb_path."""
        best = self.best()
        cases = [
            {
                "index": i,
                "label": label,
                "bucket": self.buckets[i],
                "fingerprint": self.fingerprints[i],
                "best": best[i].kernel_id if i in best else None,
            }
            for i, label in enumerate(self.cases)
        ]
        return {
            "op": self.op,
            "cases": cases,
            "rows": [r.to_dict() for r in self.rows],
            "perfdb_path": self.perfdb_path,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    _COLUMNS = (
        "case",
        "kernel",
        "status",
        "median µs",
        "p95 µs",
        "p99 µs",
        "samples",
        "outliers",
        "best",
        "detail",
    )

    def table_rows(self) -> list[tuple[str, ...]]:
        """The table's rows as strings (columns: case, kernel, status, median/p95/p99 µs, samples, outliers,
        best, detail)."""
        best = {(c, r.kernel_id) for c, r in self.best().items()}
        return [
            (
                str(r.case),
                r.kernel_id,
                r.status.value,
                _us(r.median_us),
                _us(r.p95_us),
                _us(r.p99_us),
                str(r.samples),
                str(r.outliers),
                "*" if (r.case, r.kernel_id) in best else "",
                _short(r),
            )
            for r in self.rows
        ]

    def __str__(self) -> str:
        header = [f"lz.tune {self.op}: {len(self.cases)} case(s), PerfDB {self.perfdb_path or 'not written'}"]
        header += [f"  case {i}: {label}" for i, label in enumerate(self.cases)]
        cells = [self._COLUMNS, *self.table_rows()]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self._COLUMNS))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*self._COLUMNS), "  ".join("-" * w for w in widths)]
        lines += [fmt.format(*r) for r in self.table_rows()]
        return "\n".join(header + lines)

    def __rich__(self) -> Any:
        """A ``rich`` renderable (raises ImportError without rich)."""
        from rich.console import Group
        from rich.table import Table

        title = f"lz.tune {self.op} (PerfDB: {self.perfdb_path or 'not written'})"
        t = Table(title=title, title_justify="left")
        for c in self._COLUMNS:
            t.add_column(
                c, overflow="fold", justify="right" if "µs" in c or c in ("samples", "outliers") else "left"
            )
        style = {"ok": "", "failed-check": "red", "error": "red", "ineligible": "dim"}
        for r in self.table_rows():
            t.add_row(*r, style=style[r[2]])
        labels = "\n".join(f"case {i}: {label}" for i, label in enumerate(self.cases))
        return Group(labels, t)
