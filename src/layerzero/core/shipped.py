"""Shipped timing data: measured kernel medians per device model, installed with LayerZero.

Selection scores kernels with measurements when it has them (see ``docs/tuning.md``): the user's PerfDB
first; when the PerfDB has no row for a context's bucket, the timings ``benchmarks/ship_timings.py`` measured
on the same device model and library versions; otherwise hand priorities only.

Files (``layerzero/data/timings/*.json``, one per measured machine; :data:`SCHEMA_VERSION`)::

    {"schema": 1,
     "fingerprint": {"device_type": "cuda", "name": "NVIDIA H200", "sm": "9.0", "torch": "2.11.0+cu130",
                     "cudnn": "91900"},                       # see device_fingerprint()
     "backends": {"torch_sdpa": "2.11.0+cu130", "flashinfer": "0.5.3", ...},   # measured backends' versions
     "date": "2026-11-30", "tool": "benchmarks/ship_timings.py ...",
     "defaults": {"attention": {"op": "attention", "dtype": "bfloat16", ...}},  # per op: common fields
     "records": [["attention", {"batch": 4, "seq_len_q": 1024, ...}, {"torch_sdpa.cudnn": 87.1, ...}], ...]}

A record is (op, context fields, {kernel_id: median µs}): its fields are the op's ``defaults`` updated by the
record's dict (a ``null`` value removes a default), and equal ``SelectionContext.fields()`` without the device
fields and the ``None`` values, i.e. exactly what ``SelectionContext.bucket_key()`` is built from.

Matching:

- **fingerprint**: the whole file is ignored unless :func:`device_fingerprint` of the call's device equals the
  file's (GPU: device type, name, SM, torch and cuDNN versions; CPU: type, architecture, ISA level, ATen's
  dispatch ISA, torch version). Why a file is ignored is logged once (INFO when only versions differ, DEBUG
  for another device) and listed by :func:`describe` (``layerzero doctor``).
- **backend versions**: a kernel's records are ignored when its backend's installed version differs from the
  version in the file's ``backends`` (or the backend is not listed there).
- **bucket**: the record whose fields equal the context's (*exact*); else the *nearest* record whose
  categorical fields (every field but :data:`NUMERIC_FIELDS`, :data:`SOFT_FIELDS` and ``num_heads_kv``, which
  the GQA ratio and ``num_heads_q`` imply) are equal: distance = sum over :data:`NUMERIC_FIELDS` of
  ``|log2 a - log2 b|`` plus :data:`SOFT_PENALTY` per differing :data:`SOFT_FIELDS` entry, at most
  :data:`MAX_DISTANCE`. Records equally near (a context between two grid points: batch 2 between 1 and 4) are
  combined: each kernel's median is the geometric mean over them, for the kernels usable in all of them, so
  the pick is the kernel best on both sides rather than the winner of one side (on the H200 the single nearest
  record picked a kernel at 0.75 of the best for prefill batch 2 between batches 1 and 4). When they share no
  kernel, the record with more usable kernels wins, then the larger shape.

Nothing is read at import: the files are parsed on the first lookup and memoized per directory (they are
immutable package data; :func:`clear_cache` forgets them, for tests).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import platform
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from .context import NON_BUCKET_FIELDS, SelectionContext
from .device import DeviceSpec
from .errors import ConfigurationError, expected_got

__all__ = [
    "MAX_DISTANCE",
    "NUMERIC_FIELDS",
    "SCHEMA_VERSION",
    "SOFT_FIELDS",
    "SOFT_PENALTY",
    "ShippedMatch",
    "bucket_fields",
    "clear_cache",
    "cpu_isa_level",
    "data_dir",
    "describe",
    "device_fingerprint",
    "lookup",
    "parse",
]

log = logging.getLogger("layerzero.shipped")

SCHEMA_VERSION = 1
"""The ``schema`` value this module reads; files of another schema are ignored (INFO)."""

NUMERIC_FIELDS = (
    "batch",
    "seq_len_q",
    "seq_len_kv",
    "num_heads_q",
    "hidden_size",
    "vocab_size",
    "message_bytes",
)
"""Context fields compared by distance (log2) for the nearest bucket; every other field must be equal."""

SOFT_FIELDS = ("contiguous", "aligned_16")
"""Fields that may differ from the record's at a cost of :data:`SOFT_PENALTY` each: they change a copy or a
kernel's eligibility, not the relative speed of the kernels that can run both."""

SOFT_PENALTY = 1.0
_TIE = 1e-9
"""Distances closer than this are equal (log2 sums of the same powers of two)."""
MAX_DISTANCE = 3.0
"""Largest distance of a nearest bucket, in doublings: e.g. batch x2 and seq_len_kv x4 (1 + 2), or one
doubling of a prefill length (seq_len_q and seq_len_kv: 2) and one of the batch."""

_IMPLIED = frozenset({"num_heads_kv"})
_X86_LEVELS = ("amx_bf16", "avx512_bf16", "avx512", "avx2", "avx", "sse4_2")
_ARM_LEVELS = ("sve2", "sve", "neon")


def data_dir() -> Any:
    """The package's timing-data directory (``layerzero/data/timings``), as an importlib Traversable."""
    return resources.files("layerzero").joinpath("data").joinpath("timings")


def cpu_isa_level(isa: Iterable[str]) -> str:
    """The highest ISA tier among ``DeviceSpec.cpu_isa``: ``amx_bf16`` > ``avx512_bf16`` > ``avx512`` >
    ``avx2`` > ``avx`` > ``sse4_2`` (x86), ``sve2`` > ``sve`` > ``neon`` (ARM), else ``"none"``.

    >>> cpu_isa_level({"avx", "avx2", "fma"}), cpu_isa_level(set())
    ('avx2', 'none')
    """
    have = set(isa)
    return next((level for level in (*_X86_LEVELS, *_ARM_LEVELS) if level in have), "none")


def device_fingerprint(device: DeviceSpec) -> dict[str, str]:
    """What a shipped file must match, as strings.

    CUDA/ROCm: ``device_type``, ``name``, ``sm`` (``"9.0"``; ``"none"`` on ROCm), ``torch`` (its version
    string, which names the CUDA build), ``cudnn`` (``torch.backends.cudnn.version()``, ``"none"`` if absent).
    The driver is left out: it rarely changes which kernel is fastest. CPU: ``device_type``, ``arch``
    (``platform.machine()``), ``isa`` (:func:`cpu_isa_level` of the host's features), ``aten_isa`` (the
    level ATen dispatches its vectorized kernels at, ``torch.backends.cpu.get_cpu_capability()``, lowered;
    ``ATEN_CPU_CAPABILITY`` can lower it) and ``torch``. An AVX2 and an AVX-512 CPU never share a file.
    Other devices: ``device_type``, ``name``, ``torch``.
    """
    if device.device_type == "cuda":
        return {
            "device_type": "cuda",
            "name": device.name,
            "sm": "none" if device.sm is None else f"{device.sm[0]}.{device.sm[1]}",
            "torch": device.torch_version,
            "cudnn": "none" if device.cudnn_version is None else str(device.cudnn_version),
        }
    if device.device_type == "cpu":
        get_cap = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
        aten = str(get_cap()).strip().lower().replace(" ", "_") if get_cap is not None else "unknown"
        return {
            "device_type": "cpu",
            "arch": platform.machine().lower() or "unknown",
            "isa": cpu_isa_level(device.cpu_isa),
            "aten_isa": aten,
            "torch": device.torch_version,
        }
    return {"device_type": device.device_type, "name": device.name, "torch": device.torch_version}


def bucket_fields(ctx: SelectionContext) -> dict[str, Any]:
    """The fields a record stores for ``ctx``: ``ctx.fields()`` without :data:`NON_BUCKET_FIELDS` (the
    device's, a process group's name) and ``None`` values (``SelectionContext.bucket_key()`` joins exactly
    these)."""
    return {k: v for k, v in ctx.fields().items() if k not in NON_BUCKET_FIELDS and v is not None}


def _key(fields: Mapping[str, Any]) -> str:
    return ";".join(f"{k}={v}" for k, v in sorted(fields.items()))


def _signature(fields: Mapping[str, Any]) -> tuple[Any, ...]:
    """Everything that must be equal for a nearest match: categorical items + which numeric fields exist."""
    skip = (
        set(NUMERIC_FIELDS) | set(SOFT_FIELDS) | (_IMPLIED if fields.get("gqa_ratio") is not None else set())
    )
    return (
        tuple(sorted((k, str(v)) for k, v in fields.items() if k not in skip)),
        tuple(k for k in NUMERIC_FIELDS if k in fields),
    )


def _log2s(fields: Mapping[str, Any]) -> tuple[float, ...]:
    return tuple(math.log2(max(float(fields[k]), 1.0)) for k in NUMERIC_FIELDS if k in fields)


@dataclass(frozen=True, slots=True)
class _Record:
    op: str
    fields: Mapping[str, Any]
    medians: Mapping[str, float]
    file: str
    backends: Mapping[str, str]
    log2s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class _File:
    name: str
    fingerprint: Mapping[str, str]
    backends: Mapping[str, str]
    date: str
    records: tuple[_Record, ...]


@dataclass(frozen=True, slots=True)
class ShippedMatch:
    """The shipped record selection uses for one context.

    Attributes:
        file: the data file's name (``nvidia-h200.json``).
        exact: the record's bucket is the context's; else the nearest one.
        distance: see the module docstring (0.0 when exact).
        fields: the matched record's context fields (the larger one when several were combined).
        medians: kernel id -> median µs, only kernels whose backend version matches the installed one (for
            combined records, the geometric mean over them of the kernels usable in all).
        combined: the fields of every equally near record combined into ``medians`` (empty for one record).
    """

    file: str
    exact: bool
    distance: float
    fields: Mapping[str, Any]
    medians: Mapping[str, float]
    combined: tuple[Mapping[str, Any], ...] = ()

    @property
    def source(self) -> str:
        """One line for reports: the file and which bucket, e.g. ``nvidia-h200.json, nearest bucket (distance
        1.00: batch 8)``."""
        if self.exact:
            return f"{self.file}, exact bucket"
        recs = self.combined or (self.fields,)
        parts = [
            f"{k} {' / '.join(dict.fromkeys(str(r.get(k)) for r in recs))}"
            for k in (*NUMERIC_FIELDS, *SOFT_FIELDS)
            if k in self.fields
        ]
        head = (
            f"geometric mean of {len(recs)} equally near buckets, distance {self.distance:.2f}"
            if len(recs) > 1
            else f"distance {self.distance:.2f}"
        )
        return f"{self.file}, nearest bucket ({head}: " + ", ".join(parts) + ")"

    def score(self, kernel_id: str, weight: float, tie_margin: float = 0.0) -> float:
        """``weight * fastest / this`` over :attr:`medians` (as ``perf_score``); 0.0 when not measured.

        A kernel within ``tie_margin`` of the fastest (``this <= fastest * (1 + tie_margin)``) scores the full
        ``weight``, so hand priorities order the near-tied kernels
        (``LayerZeroConfig.shipped_tie_margin``)."""
        this = self.medians.get(kernel_id)
        if this is None:
            return 0.0
        fastest = min(self.medians.values())
        if this <= 0.0 or this <= fastest * (1.0 + tie_margin):
            return float(weight)
        return float(weight) * fastest / this

    def median(self, kernel_id: str) -> float | None:
        """The shipped median of ``kernel_id`` in µs, or None."""
        return self.medians.get(kernel_id)


def _bad(name: str, what: str, expected: str, got: Any) -> ConfigurationError:
    return ConfigurationError(
        expected_got(
            f"shipped timings {name}: {what}",
            expected,
            repr(got)[:120],
            "Re-create the file with benchmarks/ship_timings.py.",
        )
    )


def parse(text: str, name: str = "<data>") -> _File:
    """Parse one data file (see the module docstring).

    Raises:
        ConfigurationError: not JSON, another schema version, or a malformed field (which one, expected vs
            got).
    """
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise _bad(name, "content", "JSON", str(exc)) from None
    if not isinstance(doc, dict):
        raise _bad(name, "top level", "an object", type(doc).__name__)
    if doc.get("schema") != SCHEMA_VERSION:
        raise _bad(name, "schema", SCHEMA_VERSION, doc.get("schema"))
    fp, backends = doc.get("fingerprint"), doc.get("backends", {})
    for what, m in (("fingerprint", fp), ("backends", backends)):
        if not isinstance(m, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in m.items()
        ):
            raise _bad(name, what, "an object of strings", m)
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict) or not all(isinstance(v, dict) for v in defaults.values()):
        raise _bad(name, "defaults", "an object of op -> fields", defaults)
    raw = doc.get("records")
    if not isinstance(raw, list):
        raise _bad(name, "records", "a list", type(raw).__name__)
    records = []
    for i, rec in enumerate(raw):
        if not (
            isinstance(rec, list)
            and len(rec) == 3
            and isinstance(rec[0], str)
            and isinstance(rec[1], dict)
            and isinstance(rec[2], dict)
        ):
            raise _bad(name, f"records[{i}]", "[op, {fields}, {kernel_id: median_us}]", rec)
        op, delta, medians = rec
        fields = {**defaults.get(op, {}), **delta}
        fields = {k: v for k, v in fields.items() if v is not None}
        if fields.get("op") != op or not all(isinstance(v, (str, int, float, bool)) for v in fields.values()):
            raise _bad(name, f"records[{i}] fields", f"op {op!r} and str/number/bool values", fields)
        for kid, us in medians.items():
            if isinstance(us, bool) or not isinstance(us, (int, float)) or not math.isfinite(us) or us < 0:
                raise _bad(name, f"records[{i}] {kid}", "a median >= 0 µs", us)
        records.append(
            _Record(op, fields, {k: float(v) for k, v in medians.items()}, name, backends, _log2s(fields))
        )
    return _File(name, fp, backends, str(doc.get("date", "")), tuple(records))


@dataclass(frozen=True, slots=True)
class _Table:
    statuses: tuple[tuple[str, str], ...]
    exact: Mapping[str, _Record]
    near: Mapping[tuple[Any, ...], tuple[_Record, ...]]


@functools.lru_cache(maxsize=8)
def _files(directory: str | None) -> tuple[tuple[str, _File | str], ...]:
    """Every ``*.json`` of ``directory`` (None = package data), parsed: (name, file or why unusable)."""
    root = data_dir() if directory is None else Path(directory)
    try:
        entries = sorted((e for e in root.iterdir() if e.name.endswith(".json")), key=lambda e: e.name)
    except OSError as exc:
        log.info("LayerZero shipped timings: cannot list %s (%s)", root, exc)
        return ()
    out: list[tuple[str, _File | str]] = []
    for entry in entries:
        try:
            out.append((entry.name, parse(entry.read_text(encoding="utf-8"), entry.name)))
        except (OSError, UnicodeDecodeError, ConfigurationError) as exc:
            log.warning("LayerZero shipped timings: %s is unusable and ignored (%s)", entry.name, exc)
            out.append((entry.name, f"unusable: {exc}"))
    return tuple(out)


def _mismatch(file_fp: Mapping[str, str], mine: Mapping[str, str]) -> str | None:
    diff = [
        f"{k} {file_fp.get(k)!r} (here {mine.get(k)!r})"
        for k in sorted(set(file_fp) | set(mine))
        if file_fp.get(k) != mine.get(k)
    ]
    return None if not diff else "measured with " + ", ".join(diff)


@functools.lru_cache(maxsize=16)
def _table(fp_items: tuple[tuple[str, str], ...], directory: str | None) -> _Table:
    mine = dict(fp_items)
    statuses: list[tuple[str, str]] = []
    exact: dict[str, _Record] = {}
    near: dict[tuple[Any, ...], list[_Record]] = {}
    same_device = ("device_type", "name", "sm", "arch", "isa")
    for name, file in _files(directory):
        if isinstance(file, str):
            statuses.append((name, file))
            continue
        why = _mismatch(file.fingerprint, mine)
        if why is not None:
            statuses.append((name, "ignored: " + why))
            level = (
                logging.INFO
                if all(file.fingerprint.get(k) == mine.get(k) for k in same_device)
                else logging.DEBUG
            )
            log.log(level, "LayerZero shipped timings %s ignored for this device: %s", name, why)
            continue
        statuses.append((name, f"used ({len(file.records)} buckets, measured {file.date or 'unknown date'})"))
        log.info("LayerZero shipped timings: using %s (%d buckets)", name, len(file.records))
        for rec in file.records:
            exact.setdefault(rec.op + "|" + _key(rec.fields), rec)
            near.setdefault((rec.op, _signature(rec.fields)), []).append(rec)
    return _Table(tuple(statuses), exact, {k: tuple(v) for k, v in near.items()})


def clear_cache() -> None:
    """Forget the parsed files and per-device tables (tests that write data files use this)."""
    _files.cache_clear()
    _table.cache_clear()


def describe(device: DeviceSpec, directory: str | None = None) -> list[tuple[str, str]]:
    """(file name, status) of every data file for ``device``: used, ignored and why, or unusable. Reads
    the files on first use."""
    return list(_table(tuple(sorted(device_fingerprint(device).items())), directory).statuses)


def _usable(
    rec: _Record, backend_version: Callable[[str], tuple[str, str | None] | None]
) -> dict[str, float]:
    out = {}
    for kid, us in rec.medians.items():
        bv = backend_version(kid)
        if bv is not None and bv[1] is not None and rec.backends.get(bv[0]) == bv[1]:
            out[kid] = us
    return out


def lookup(
    ctx: SelectionContext,
    backend_version: Callable[[str], tuple[str, str | None] | None],
    directory: str | None = None,
) -> ShippedMatch | None:
    """The shipped record for ``ctx`` (exact bucket, else the nearest within :data:`MAX_DISTANCE`), or None.

    Args:
        ctx: the call's context (its device picks the data file).
        backend_version: kernel id -> (backend id, installed version), or None for an unknown kernel; a
            kernel's medians count only when that version equals the file's for the backend.
        directory: a directory of data files instead of the package's
            (``lz.configure(shipped_timings_dir=)``).

    Reads and parses the files on the first call for a device (logged), memoized afterwards; never raises
    for a missing or malformed file (logged, ignored).
    """
    table = _table(tuple(sorted(device_fingerprint(ctx.device).items())), directory)
    if not table.exact:
        return None
    fields = bucket_fields(ctx)
    rec = table.exact.get(ctx.op + "|" + _key(fields))
    if rec is not None:
        medians = _usable(rec, backend_version)
        if medians:
            return ShippedMatch(rec.file, True, 0.0, rec.fields, medians)
    candidates = table.near.get((ctx.op, _signature(fields)))
    if not candidates:
        return None
    mine = _log2s(fields)
    near: list[tuple[float, int, float, _Record, dict[str, float]]] = []
    for cand in candidates:
        d = sum(abs(a - b) for a, b in zip(mine, cand.log2s, strict=True))
        d += SOFT_PENALTY * sum(fields.get(k) != cand.fields.get(k) for k in SOFT_FIELDS)
        if d > MAX_DISTANCE or (near and d > near[0][0] + _TIE):
            continue
        medians = _usable(cand, backend_version)
        if not medians:
            continue
        if near and d < near[0][0] - _TIE:
            near.clear()
        near.append((d, -len(medians), -sum(cand.log2s), cand, medians))
    if not near:
        return None
    near.sort(key=lambda n: n[:3])
    d, _, _, rec, medians = near[0]
    common = set.intersection(*(set(n[4]) for n in near))
    if len(near) > 1 and common:
        by_size = sorted(near, key=lambda n: n[2])  # the largest shape first
        geo = {
            k: math.exp(sum(math.log(max(n[4][k], 1e-9)) for n in near) / len(near)) for k in sorted(common)
        }
        return ShippedMatch(
            rec.file, d == 0.0, d, by_size[0][3].fields, geo, tuple(n[3].fields for n in by_size)
        )
    return ShippedMatch(rec.file, d == 0.0, d, rec.fields, medians)
