"""``DispatchTable``: an offline plan, op x shape bucket -> kernel id, saved as fingerprinted JSON.

An entry is keyed by ``(op, SelectionContext.bucket_key())``: the same bucket the selection cache and the
PerfDB use, so one solved shape stands for every call of its bucket. The fingerprint names what the choices
depend on: the device (``core/shipped.device_fingerprint`` per device type in the table), LayerZero, torch and
backend versions, and the hash of the effective policy. :func:`load_table` (and ``lz.install_table``) refuse a
table whose fingerprint differs from this process with :class:`TableMismatchError` listing every differing
field.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from layerzero._version import __version__
from layerzero.core import config as _config
from layerzero.core.errors import ConfigurationError, expected_got

TABLE_VERSION = 1


class TableError(ConfigurationError):
    """A dispatch table file is malformed (not JSON, wrong schema version, missing fields)."""


class TableMismatchError(ConfigurationError):
    """A dispatch table was solved for another device, library version or policy.

    ``fields``: ``[(name, expected (the table's), got (this process's)), ...]`` for every differing field."""

    def __init__(self, message: str, fields: list[tuple[str, Any, Any]]) -> None:
        super().__init__(message)
        self.fields = fields


@dataclass(frozen=True)
class TableEntry:
    """One solved bucket: ``op``, ``bucket`` (``SelectionContext.bucket_key()``), ``device`` type, the context
    ``fields``, ``kernel_id``, ``why`` (a one-line summary of the score), ``rejected`` (kernel -> reason
    codes), ``notes`` (fallback/lock notes of the report) and ``measured_us`` (PerfDB median, None when
    unmeasured)."""

    op: str
    bucket: str
    device: str
    kernel_id: str
    why: str
    fields: dict[str, Any] = field(default_factory=dict)
    rejected: dict[str, list[str]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    measured_us: float | None = None


def current_fingerprint(device_types: set[str] | frozenset[str]) -> dict[str, Any]:
    """This process's fingerprint for tables covering ``device_types`` (e.g. ``{"cpu"}``): ``layerzero``,
    ``torch``, ``backends`` (id -> installed version or ``"unavailable"``), ``policy_hash``, ``devices``
    (device type -> :func:`layerzero.core.shipped.device_fingerprint`)."""
    from layerzero.core.device import DeviceSpec
    from layerzero.core.runtime import RUNTIME
    from layerzero.core.shipped import device_fingerprint

    RUNTIME.ensure_ready()
    backends = {
        b.backend_id: (b.version or "builtin") if b.available else "unavailable"
        for b in RUNTIME.registry.backends.values()
    }
    devices = {t: device_fingerprint(DeviceSpec.detect(t)) for t in sorted(device_types)}
    return {
        "layerzero": __version__,
        "torch": torch.__version__,
        "backends": backends,
        "policy_hash": _config.effective_policy().hash,
        "devices": devices,
    }


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def fingerprint_diff(expected: dict[str, Any], got: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Differing dotted fields ``(name, expected, got)`` of two fingerprints (a missing side is None)."""
    a, b = _flat(expected), _flat(got)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


@dataclass(frozen=True)
class DispatchTable:
    """Solved kernel choices (:class:`TableEntry` per op x bucket) and the fingerprint they hold for.

    ``lookup(op, bucket)`` -> entry or None; ``save(path)``; ``print()`` for a table;
    ``lz.install_table(table)`` installs it."""

    entries: tuple[TableEntry, ...]
    fingerprint: dict[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {(e.op, e.bucket): e for e in self.entries})

    def lookup(self, op: str, bucket: str) -> TableEntry | None:
        """The entry of ``op``'s ``bucket`` (``SelectionContext.bucket_key()``), or None."""
        return self._index.get((op, bucket))  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.entries)

    def check(self) -> None:
        """Raise :class:`TableMismatchError` when this process's fingerprint differs from the table's."""
        mine = current_fingerprint(set(self.fingerprint.get("devices", {})))
        diffs = fingerprint_diff(self.fingerprint, mine)
        if diffs:
            shown = "; ".join(f"{n}: expected {e!r}, got {g!r}" for n, e, g in diffs[:8])
            more = f" (+{len(diffs) - 8} more)" if len(diffs) > 8 else ""
            raise TableMismatchError(
                f"dispatch table was solved for another setup; {len(diffs)} fingerprint field(s) differ: "
                f"{shown}{more}. Solve the table again on this machine with this policy (lz.solve / "
                "`layerzero solve`).",
                diffs,
            )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"version", "fingerprint", "entries": [...]}``."""
        return {
            "version": TABLE_VERSION,
            "fingerprint": self.fingerprint,
            "entries": [{**asdict(e), "notes": list(e.notes)} for e in self.entries],
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table as JSON to ``path`` (OSError when it cannot be written)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True, default=str)

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """``(op, bucket, kernel, measured, why)`` rows for display."""
        return [
            (e.op, e.bucket, e.kernel_id, "" if e.measured_us is None else f"{e.measured_us:.1f} us", e.why)
            for e in self.entries
        ]

    def __str__(self) -> str:
        rows = [("op", "bucket", "kernel", "measured", "why"), *self.rows()]
        widths = [min(60, max(len(r[i]) for r in rows)) for i in range(5)]
        return "\n".join(
            "  ".join(c[:60].ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )

    @classmethod
    def from_dict(cls, data: Any, source: str = "<table>") -> DispatchTable:
        """Parse the JSON form (no fingerprint check). Raises :class:`TableError`."""
        if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
            got = f"version {data.get('version')!r}" if isinstance(data, dict) else type(data).__name__
            raise TableError(
                expected_got(
                    source,
                    f'a dispatch table object with "version": {TABLE_VERSION}',
                    got,
                    "Write it with DispatchTable.save / `layerzero solve`.",
                )
            )
        fp, raw = data.get("fingerprint"), data.get("entries")
        if not isinstance(fp, dict) or not isinstance(raw, list):
            raise TableError(
                expected_got(
                    source,
                    '"fingerprint" an object and "entries" a list',
                    f"{type(fp).__name__} / {type(raw).__name__}",
                )
            )
        entries = []
        for i, e in enumerate(raw):
            try:
                entries.append(TableEntry(**{**e, "notes": tuple(e.get("notes", ()))}))
            except (TypeError, AttributeError) as exc:
                raise TableError(
                    expected_got(
                        f"{source}: entries[{i}]",
                        "an object with op, bucket, device, "
                        "kernel_id, why (and optional fields, rejected, notes, measured_us)",
                        str(exc),
                    )
                ) from None
        return cls(tuple(entries), fp)


def load_table(path: str | os.PathLike[str], *, check: bool = True) -> DispatchTable:
    """Read a table written by :meth:`DispatchTable.save`; with ``check`` (default) refuse one whose
    fingerprint differs from this process (device, LayerZero / torch / backend versions, policy hash).

    Raises:
        TableMismatchError: a fingerprint field differs (``.fields`` lists them, expected vs got).
        TableError: not JSON or not a dispatch table. OSError: unreadable file.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise TableError(f"{path}: not valid JSON ({exc})") from None
    table = DispatchTable.from_dict(data, str(path))
    if check:
        table.check()
    return table


__all__ = [
    "TABLE_VERSION",
    "DispatchTable",
    "TableEntry",
    "TableError",
    "TableMismatchError",
    "current_fingerprint",
    "fingerprint_diff",
    "load_table",
]
