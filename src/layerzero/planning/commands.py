"""``layerzero solve | dry-run | readiness``: the planning subcommands of the ``layerzero`` CLI (``cli.py``).

- ``layerzero solve --manifest FILE.json --out TABLE.json [--device cuda]``: solve the manifest, write the
  table, print it.
- ``layerzero dry-run --manifest FILE.json`` or ``layerzero dry-run module:function``: print what would run
  where (the function is imported and called with no arguments inside ``lz.dry_run``; it builds its own
  inputs).
- ``layerzero readiness [--table TABLE.json] [--json]``: exit code 0 when ready, 1 when not.
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from layerzero.core.errors import ConfigurationError


def _cmd_solve(ns: argparse.Namespace) -> int:
    from .solve import solve

    table = solve(ns.manifest, target=ns.device)
    table.save(ns.out)
    print(table)
    print(f"\n{len(table)} entries written to {ns.out}")
    return 0


def _target(spec: str) -> Any:
    mod, _, name = spec.partition(":")
    if not mod or not name:
        raise ConfigurationError(
            f"layerzero dry-run: expected --manifest FILE.json or module:function, got {spec!r}."
        )
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"layerzero dry-run: cannot load {spec!r} ({type(exc).__name__}: {exc})."
        ) from None


def _cmd_dry_run(ns: argparse.Namespace) -> int:
    from layerzero import ops as lz_ops

    from .dryrun import dry_run
    from .manifest import load_manifest

    if ns.manifest:
        manifest = load_manifest(ns.manifest, device=ns.device)

        def fn() -> None:
            for case in manifest:
                getattr(lz_ops, case.op)(*case.args, **case.kwargs)
    elif ns.target:
        fn = _target(ns.target)
    else:
        raise ConfigurationError("layerzero dry-run: give --manifest FILE.json or module:function.")
    report = dry_run(fn)
    print(json.dumps(report.to_dict(), indent=1, default=str) if ns.json else report)
    return 0


def _cmd_readiness(ns: argparse.Namespace) -> int:
    from .readiness import readiness_check
    from .table import load_table

    table = load_table(ns.table, check=False) if ns.table else None
    report = readiness_check(table)
    print(json.dumps(report.to_dict(), indent=1) if ns.json else report)
    return 0 if report.ok else 1


def add_parsers(sub: Any) -> None:
    """Add the ``solve``, ``dry-run`` and ``readiness`` subcommands to ``sub`` (argparse subparsers)."""
    s = sub.add_parser("solve", help="solve a manifest's kernel choices offline into a dispatch table (JSON)")
    s.add_argument("--manifest", required=True, help="manifest JSON (docs/planning.md)")
    s.add_argument("--out", required=True, help="dispatch table JSON to write")
    s.add_argument("--device", default=None, help="device for the manifest's tensors (default: the file's)")
    s.set_defaults(fn=_cmd_solve)
    d = sub.add_parser("dry-run", help="what would run where for a manifest or a function (no kernel runs)")
    d.add_argument("target", nargs="?", default=None, help="module:function, called with no arguments")
    d.add_argument("--manifest", default=None)
    d.add_argument("--device", default=None)
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=_cmd_dry_run)
    r = sub.add_parser("readiness", help="can this process serve? exit 0 when ready, 1 when not")
    r.add_argument("--table", default=None, help="also check this dispatch table's fingerprint")
    r.add_argument("--json", action="store_true")
    r.set_defaults(fn=_cmd_readiness)
