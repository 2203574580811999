"""Offline plans and warm-up manifests (docs/planning.md).

``lz.solve`` (manifest -> :class:`DispatchTable`), ``DispatchTable.save`` / ``lz.load_table`` (fingerprinted
JSON), ``lz.install_table`` / ``lz.uninstall_table`` (serve a table's choices on cache misses), ``lz.dry_run``
(what would run where, running nothing heavy), ``lz.readiness_check`` and ``lz.warmup(manifest, timeout_s=...,
background=...)``. Built on ``core``; ``core`` never imports it.
"""

from __future__ import annotations

from .dryrun import DryRunReport, DryRunRow, dry_run
from .manifest import Case, Manifest, ManifestError, load_manifest
from .readiness import Check, ReadinessReport, readiness_check
from .solve import (
    CompiledTable,
    TableMissError,
    compile,
    compiled_table,
    install_table,
    solve,
    uncompile,
    uninstall_table,
)
from .table import DispatchTable, TableEntry, TableError, TableMismatchError, load_table
from .warmup import WarmupHandle, warmup_manifest

__all__ = [
    "Case",
    "Check",
    "CompiledTable",
    "DispatchTable",
    "DryRunReport",
    "DryRunRow",
    "Manifest",
    "ManifestError",
    "ReadinessReport",
    "TableEntry",
    "TableError",
    "TableMismatchError",
    "TableMissError",
    "WarmupHandle",
    "compile",
    "compiled_table",
    "dry_run",
    "install_table",
    "load_manifest",
    "load_table",
    "readiness_check",
    "solve",
    "uncompile",
    "uninstall_table",
    "warmup_manifest",
]
