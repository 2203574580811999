"""PerfDB: measured kernel timings in SQLite, keyed by kernel x op x context bucket x fingerprint.

The store is a cache of measurements, not a source of truth: anything in it can be measured again.
That decides every recovery choice below (rebuild rather than migrate, quarantine rather than repair).

File format
    * one ``WITHOUT ROWID`` table ``perf_records`` whose primary key is the columns
      (op, bucket, fingerprint, kernel_id); that column order makes :meth:`PerfDB.for_bucket` a prefix
      range scan of the primary key (one indexed SELECT, no second index);
    * ``PRAGMA journal_mode=WAL``, ``PRAGMA busy_timeout`` (5000 ms by default) and
      ``PRAGMA synchronous=NORMAL``, so several processes can share one file;
    * ``PRAGMA user_version = SCHEMA_VERSION``. A file with another non-zero ``user_version`` is
      **rebuilt** (the table is dropped and re-created empty, with a WARNING), never migrated: old
      timings were taken by another LayerZero and are cheaper to re-measure than to convert.
      Other tables in the file are left alone.

Corruption
    A file that is not a SQLite database, fails ``PRAGMA integrity_check``, or has ``user_version ==
    SCHEMA_VERSION`` but a table of the wrong shape is moved aside to ``"<path>.corrupt-<unix time>"``
    (with its ``-wal``/``-shm`` side files as ``"<that name>-wal"``/``"-shm"``), a WARNING with the
    reason is logged on ``layerzero.core.perfdb``, and an empty database is built in its place. The same
    happens once if a query later reports corruption; the failed call is then retried on the new file.

Threads and processes
    One connection per :class:`PerfDB`, opened with ``check_same_thread=False`` and guarded by an
    ``RLock``: calls from many threads are serialized (each is a single short statement). Processes
    share the file through WAL and the busy timeout. After ``os.fork()`` the child re-opens its own
    connection on first use (file databases only; an in-memory database stays private to its process).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from layerzero.core.errors import CacheCorruptionError, ConfigurationError, InvalidInputError, expected_got

__all__ = ["SCHEMA_VERSION", "PerfDB", "PerfRecord", "fingerprint", "perf_score", "summarize_samples"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Value of ``PRAGMA user_version`` this module writes; bump it whenever the table changes."""

_TABLE = "perf_records"
_COLUMNS = (
    "kernel_id",
    "op",
    "bucket",
    "fingerprint",
    "median_us",
    "p95_us",
    "variance_us2",
    "samples",
    "created_at",
)
_SCHEMA = f"""CREATE TABLE IF NOT EXISTS {_TABLE} (
    kernel_id TEXT NOT NULL, op TEXT NOT NULL, bucket TEXT NOT NULL, fingerprint TEXT NOT NULL,
    median_us REAL NOT NULL, p95_us REAL NOT NULL, variance_us2 REAL NOT NULL, samples INTEGER NOT NULL,
    created_at REAL NOT NULL, PRIMARY KEY (op, bucket, fingerprint, kernel_id)) WITHOUT ROWID"""
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM {_TABLE}"
_INSERT = f"INSERT OR REPLACE INTO {_TABLE} ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * 9)})"
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class PerfRecord:
    """One measured timing summary of one kernel on one context bucket on one machine fingerprint.

    Attributes:
        kernel_id: kernel id, e.g. ``"torch_sdpa.flash"``.
        op: op id, e.g. ``"attention"``.
        bucket: context bucket key (built by dispatch from the call's shapes and flags).
        fingerprint: :func:`fingerprint` of the machine and library versions that measured it.
        median_us: median of the samples, µs (mean of the two middle values for an even count).
        p95_us: 95th percentile by nearest rank, µs (``numpy.percentile(method="inverted_cdf")``).
        variance_us2: population variance (ddof=0) of the samples, µs².
        samples: number of samples summarized.
        created_at: when it was recorded, unix seconds (``time.time()``).
    """

    kernel_id: str
    op: str
    bucket: str
    fingerprint: str
    median_us: float
    p95_us: float
    variance_us2: float
    samples: int
    created_at: float


def fingerprint(parts: Mapping[str, str]) -> str:
    """Hash what makes a timing comparable: device name, SM, driver, CUDA, torch and backend versions.

    The canonical form is the JSON of the items sorted by key (no whitespace), so insertion order does
    not matter; the result is the first 16 hex characters of its SHA-256. Records of another
    fingerprint are never matched by :meth:`PerfDB.lookup` / :meth:`PerfDB.for_bucket`.

    Args:
        parts: e.g. ``{"device": "NVIDIA H100", "sm": "9.0", "driver": "550.54", "cuda": "12.4",
            "torch": "2.5.1", "flash_attn": "2.6.3"}``. Keys and values must be ``str``.

    Returns:
        16 lowercase hex characters.

    Raises:
        InvalidInputError: ``parts`` is not a mapping, or a key or value is not a ``str``.

    >>> fingerprint({"torch": "2.5.1", "sm": "9.0"}) == fingerprint({"sm": "9.0", "torch": "2.5.1"})
    True
    """
    if not isinstance(parts, Mapping):
        raise InvalidInputError(
            expected_got(
                "fingerprint(parts)",
                "a Mapping[str, str]",
                type(parts).__name__,
                "Pass a dict such as {'device': ..., 'torch': ...}.",
            )
        )
    for key, value in parts.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidInputError(
                expected_got(
                    f"fingerprint(parts) item {key!r}",
                    "str keys and str values",
                    f"{type(key).__name__} -> {type(value).__name__}",
                    "Convert versions with str() first.",
                )
            )
    canonical = json.dumps(sorted(parts.items()), separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:16]


def summarize_samples(samples_us: Iterable[float]) -> tuple[float, float, float, int]:
    """Return ``(median_us, p95_us, variance_us2, n)`` of timing samples given in µs.

    median: middle value (mean of the two middle values when ``n`` is even), as ``numpy.median``;
    p95: nearest rank, the ``ceil(0.95 * n)``-th smallest sample (``numpy.percentile(...,
    method="inverted_cdf")``, Hyndman & Fan 1996 definition 1); variance: population variance
    (ddof=0), two-pass with ``math.fsum``.

    Raises:
        InvalidInputError: not a sequence of real numbers, empty, or a sample NaN, infinite or negative.
    """
    if isinstance(samples_us, (str, bytes, Mapping)) or not isinstance(samples_us, Iterable):
        raise InvalidInputError(
            expected_got(
                "samples_us",
                "a sequence of timings in µs",
                type(samples_us).__name__,
                "Pass e.g. [12.5, 12.7, 13.0].",
            )
        )
    values: list[float] = []
    for i, x in enumerate(samples_us):
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise InvalidInputError(
                expected_got(
                    f"samples_us[{i}]", "a real number (µs)", repr(x), "Convert tensors with .tolist() first."
                )
            )
        xf = float(x)
        if not math.isfinite(xf) or xf < 0.0:
            raise InvalidInputError(
                expected_got(
                    f"samples_us[{i}]",
                    "a finite timing >= 0 µs",
                    xf,
                    "Drop failed or unfinished measurements before recording.",
                )
            )
        values.append(xf)
    n = len(values)
    if n == 0:
        raise InvalidInputError(
            expected_got(
                "samples_us",
                "at least one sample",
                "an empty sequence",
                "Measure the kernel at least once before recording.",
            )
        )
    values.sort()
    mid = n // 2
    median = values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2.0
    rank = (95 * n + 99) // 100  # ceil(0.95 * n) in exact integer arithmetic
    p95 = values[rank - 1]
    mean = math.fsum(values) / n
    variance = math.fsum((x - mean) ** 2 for x in values) / n
    return median, p95, variance, n


def perf_score(records: Mapping[str, PerfRecord], kernel_id: str, weight: float = 1000.0) -> float:
    """Score term for measured speed: ``weight * fastest_median / this_median``, or 0.0 if unmeasured.

    ``records`` is :meth:`PerfDB.for_bucket`'s result (kernel_id -> record). The fastest measured
    kernel gets ``weight``, one twice as slow ``weight / 2``, and a kernel without a record 0.0. So a
    measured kernel outranks an unmeasured one whose priority is within ``weight * fastest / its
    median`` of it: measurement beats guesswork among kernels of similar priority. A median of 0 µs
    (below timer resolution) counts as fastest; when the fastest is 0 µs, slower kernels get 0.0.

    Raises:
        InvalidInputError: ``weight`` is negative or not finite.
    """
    if (
        isinstance(weight, bool)
        or not isinstance(weight, numbers.Real)
        or not math.isfinite(weight)
        or weight < 0
    ):
        raise InvalidInputError(expected_got("perf_score(weight)", "a finite number >= 0", repr(weight)))
    rec = records.get(kernel_id)
    if rec is None:
        return 0.0
    if rec.median_us <= 0.0:
        return float(weight)
    fastest = min(r.median_us for r in records.values())
    return float(weight) * fastest / rec.median_us


def _check_key(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInputError(expected_got(name, "a non-empty str", repr(value)))
    return value


def _is_corruption(exc: BaseException) -> bool:
    """SQLITE_NOTADB / SQLITE_CORRUPT surface as DatabaseError; busy/locked/IO as OperationalError."""
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)


class PerfDB:
    """SQLite store of measured kernel timings (see the module docstring for format and recovery).

    Args:
        path: database file (parent directories are created), or ``None`` for a private in-memory
            database (journal mode ``memory``; nothing is persisted).
        busy_timeout_ms: how long a statement waits for another process's lock, ms.
        clock: source of ``created_at``, unix seconds (tests pass a fake).

    Raises:
        ConfigurationError: the file cannot be opened (directory, permissions, locked past the timeout)
            or ``busy_timeout_ms`` is negative.
        CacheCorruptionError: the file was corrupt and the freshly rebuilt database is too.

    >>> with PerfDB() as db:
    ...     rec = db.record("torch_sdpa.math", "attention", "b1", "0123456789abcdef", [10.0, 12.0, 11.0])
    ...     rec.median_us
    11.0
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        busy_timeout_ms: int = 5000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(busy_timeout_ms, bool) or not isinstance(busy_timeout_ms, int) or busy_timeout_ms < 0:
            raise ConfigurationError(
                expected_got("PerfDB(busy_timeout_ms)", "an int >= 0 (ms)", repr(busy_timeout_ms))
            )
        self._path = None if path is None else Path(os.fspath(path))
        self._busy_timeout_ms = busy_timeout_ms
        self._clock = clock
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._inherited: sqlite3.Connection | None = None
        self._closed = False
        self._pid = os.getpid()
        if self._path is not None:
            try:
                self._path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigurationError(
                    expected_got(
                        "PerfDB could not create its directory",
                        "a writable location",
                        f"{self._path} ({exc})",
                        "Pass a path in a writable directory, or None for an in-memory PerfDB.",
                    )
                ) from exc
        self._conn = self._open()

    # ----------------------------------------------------------------------------------- opening
    @property
    def path(self) -> Path | None:
        """The database file, or ``None`` for an in-memory database."""
        return self._path

    def _connect(self) -> sqlite3.Connection:
        target = ":memory:" if self._path is None else str(self._path)
        conn = sqlite3.connect(
            target, timeout=self._busy_timeout_ms / 1000.0, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            if self._path is not None:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    logger.warning(
                        "PerfDB %s: journal_mode is %r, not 'wal'; concurrent processes will "
                        "block each other more",
                        self._path,
                        mode,
                    )
                conn.execute("PRAGMA synchronous = NORMAL")
            return conn
        except BaseException:
            conn.close()
            raise

    def _validate_and_init(self, conn: sqlite3.Connection) -> str | None:
        """Create or check the schema; return a corruption reason, or None when the db is usable."""
        check = [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]
        if check != ["ok"]:
            return f"PRAGMA integrity_check reported {check[:5]!r}"
        if conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:  # usual case: no write lock
            return self._check_columns(conn)
        conn.execute("BEGIN IMMEDIATE")  # re-read under the write lock: another process may have built it
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            exists = (
                conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (_TABLE,)
                ).fetchone()
                is not None
            )
            if version != SCHEMA_VERSION:
                if exists or version != 0:
                    logger.warning(
                        "PerfDB %s: schema version %s != %s; rebuilding the table empty "
                        "(timings are re-measured, not migrated)",
                        self._path,
                        version,
                        SCHEMA_VERSION,
                    )
                conn.execute(f"DROP TABLE IF EXISTS {_TABLE}")
                conn.execute(_SCHEMA)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return self._check_columns(conn)

    @staticmethod
    def _check_columns(conn: sqlite3.Connection) -> str | None:
        cols = tuple(row[1] for row in conn.execute(f"PRAGMA table_info({_TABLE})"))
        if sorted(cols) == sorted(_COLUMNS):
            return None
        return expected_got(
            f"table {_TABLE} (user_version {SCHEMA_VERSION})", f"columns {_COLUMNS}", cols or "no such table"
        )

    def _open(self, *, fresh: bool = False) -> sqlite3.Connection:
        """Connect and check; on corruption quarantine the file and retry once on a fresh one."""
        conn = None
        try:
            conn = self._connect()
            problem = self._validate_and_init(conn)
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            if not _is_corruption(exc):
                raise self._open_error(exc) from exc
            problem = f"{type(exc).__name__}: {exc}"
        else:
            if problem is None:
                return conn
            conn.close()
        if fresh:
            raise CacheCorruptionError(
                f"PerfDB {self._path}: the rebuilt database failed too ({problem}). "
                "Check the disk and the directory's permissions, or use another path."
            )
        self._quarantine(problem)
        return self._open(fresh=True)

    def _open_error(self, exc: sqlite3.Error) -> ConfigurationError:
        return ConfigurationError(
            expected_got(
                "PerfDB could not open its file",
                "a writable SQLite file path",
                f"{self._path} ({exc})",
                "Pass a path in a writable directory, or None for an in-memory PerfDB; if another process "
                "holds a lock, raise busy_timeout_ms.",
            )
        )

    def _quarantine(self, reason: str) -> None:
        """Move the corrupt file (and its -wal/-shm) aside, then log a WARNING. File databases only."""
        if self._path is None:
            raise CacheCorruptionError(f"in-memory PerfDB is corrupt: {reason}. Create a new PerfDB().")
        base = f"{self._path}.corrupt-{int(time.time())}"
        dest, i = base, 1
        while os.path.exists(dest):
            dest, i = f"{base}.{i}", i + 1
        for src, dst in (
            (str(self._path), dest),
            (f"{self._path}-wal", f"{dest}-wal"),
            (f"{self._path}-shm", f"{dest}-shm"),
        ):
            try:
                os.replace(src, dst)
            except FileNotFoundError:  # absent, or another process quarantined it first
                pass
        logger.warning(
            "PerfDB %s is corrupt (%s); moved it to %s and rebuilt an empty database",
            self._path,
            reason,
            dest,
        )

    # ------------------------------------------------------------------------------- statements
    def _run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn(conn)`` under the lock; quarantine, rebuild and retry once on corruption."""
        if self._pid != os.getpid() and self._path is not None:  # forked child: never share a connection
            self._lock, self._pid = threading.RLock(), os.getpid()
            if self._conn is not None:  # keep the parent's connection referenced: closing it here would
                self._inherited, self._conn = self._conn, self._open()  # checkpoint the parent's WAL
        with self._lock:
            if self._closed or self._conn is None:
                raise ConfigurationError(
                    expected_got(
                        "PerfDB",
                        "an open database",
                        "a closed one",
                        "Create a new PerfDB(path) after close().",
                    )
                )
            try:
                return fn(self._conn)
            except sqlite3.Error as exc:
                if not _is_corruption(exc) or self._path is None:
                    raise CacheCorruptionError(
                        f"PerfDB {self._path or ':memory:'} failed: {exc}. If another process holds a long "
                        "write lock, raise busy_timeout_ms; if the disk is full, free space."
                    ) from exc
                self._conn.close()
                self._conn = None
                self._quarantine(f"{type(exc).__name__}: {exc}")
                self._conn = self._open(fresh=True)
                try:
                    return fn(self._conn)
                except sqlite3.Error as exc2:
                    raise CacheCorruptionError(
                        f"PerfDB {self._path} failed again after rebuilding: {exc2}. "
                        "Check the disk, or use another path."
                    ) from exc2

    def record(
        self, kernel_id: str, op: str, bucket: str, fingerprint: str, samples_us: Iterable[float]
    ) -> PerfRecord:
        """Summarize ``samples_us`` (timings in µs) and upsert the row for this key.

        The newest measurement replaces the previous one for the same (kernel_id, op, bucket,
        fingerprint): runs taken at different times are not merged. See :func:`summarize_samples`
        for the statistics.

        Returns:
            The stored :class:`PerfRecord`.

        Raises:
            InvalidInputError: a key is not a non-empty str, or samples are empty, NaN, infinite,
                negative or not numbers.
            ConfigurationError: the PerfDB is closed.
            CacheCorruptionError: SQLite failed (lock timeout, disk full, corruption not repaired).
        """
        key = (
            _check_key("kernel_id", kernel_id),
            _check_key("op", op),
            _check_key("bucket", bucket),
            _check_key("fingerprint", fingerprint),
        )
        median, p95, variance, n = summarize_samples(samples_us)
        rec = PerfRecord(
            *key,
            median_us=median,
            p95_us=p95,
            variance_us2=variance,
            samples=n,
            created_at=float(self._clock()),
        )
        values = tuple(getattr(rec, c) for c in _COLUMNS)
        self._run(lambda c: c.execute(_INSERT, values))
        return rec

    def lookup(self, kernel_id: str, op: str, bucket: str, fingerprint: str) -> PerfRecord | None:
        """Return the record for exactly this key, or ``None`` (also for another fingerprint's rows).

        Raises:
            InvalidInputError: a key is not a non-empty str.
            ConfigurationError: the PerfDB is closed.
            CacheCorruptionError: SQLite failed (see :meth:`record`).
        """
        args = (
            _check_key("op", op),
            _check_key("bucket", bucket),
            _check_key("fingerprint", fingerprint),
            _check_key("kernel_id", kernel_id),
        )
        sql = f"{_SELECT} WHERE op = ? AND bucket = ? AND fingerprint = ? AND kernel_id = ?"
        row = self._run(lambda c: c.execute(sql, args).fetchone())
        return None if row is None else PerfRecord(*row)

    def for_bucket(self, op: str, bucket: str, fingerprint: str) -> dict[str, PerfRecord]:
        """Every measured kernel of ``op`` on ``bucket`` under ``fingerprint``: ``{kernel_id: record}``.

        One SELECT on a prefix of the primary key (an index range scan). Called by selection on
        cache misses; feed the result to :func:`perf_score`.

        Raises:
            InvalidInputError: a key is not a non-empty str.
            ConfigurationError: the PerfDB is closed.
            CacheCorruptionError: SQLite failed (see :meth:`record`).
        """
        args = (_check_key("op", op), _check_key("bucket", bucket), _check_key("fingerprint", fingerprint))
        sql = f"{_SELECT} WHERE op = ? AND bucket = ? AND fingerprint = ?"
        rows = self._run(lambda c: c.execute(sql, args).fetchall())
        return {row[0]: PerfRecord(*row) for row in rows}

    def clear(self, op: str | None = None) -> int:
        """Delete every row (``op=None``) or the rows of one op; return how many rows were deleted.

        Raises:
            InvalidInputError: ``op`` is given but not a non-empty str.
        """
        if op is None:
            return self._run(lambda c: c.execute(f"DELETE FROM {_TABLE}").rowcount)
        op = _check_key("op", op)
        return self._run(lambda c: c.execute(f"DELETE FROM {_TABLE} WHERE op = ?", (op,)).rowcount)

    def __len__(self) -> int:
        """Number of rows, every op and fingerprint included."""
        return self._run(lambda c: c.execute(f"SELECT COUNT(*) FROM {_TABLE}").fetchone()[0])

    def close(self) -> None:
        """Close the connection (idempotent); later calls raise :class:`ConfigurationError`."""
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> PerfDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"PerfDB(path={str(self._path) if self._path else ':memory:'!r}, {state})"
