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

Layout: this module holds :class:`PerfDB` (the connection's lifetime, locking, retry and the statements);
the table, pragmas, version check and quarantine are in :mod:`.perfdb_schema`; :class:`PerfRecord`,
:func:`fingerprint`, :func:`summarize_samples` and :func:`perf_score` (no SQLite) are in
:mod:`.perfdb_records` and re-exported here.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from layerzero.core.errors import CacheCorruptionError, ConfigurationError, InvalidInputError, expected_got
from layerzero.core.perfdb_records import PerfRecord, fingerprint, perf_score, summarize_samples
from layerzero.core.perfdb_schema import (
    COLUMNS,
    INSERT,
    SCHEMA_VERSION,
    SELECT,
    TABLE,
    connect,
    is_corruption,
    quarantine,
    validate_and_init,
)

__all__ = ["SCHEMA_VERSION", "PerfDB", "PerfRecord", "fingerprint", "perf_score", "summarize_samples"]

_T = TypeVar("_T")


def _check_key(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInputError(expected_got(name, "a non-empty str", repr(value)))
    return value


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

    def _open(self, *, fresh: bool = False) -> sqlite3.Connection:
        """Connect and check; on corruption quarantine the file and retry once on a fresh one."""
        conn = None
        try:
            conn = connect(self._path, self._busy_timeout_ms)
            problem = validate_and_init(conn, self._path)
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            if not is_corruption(exc):
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
        quarantine(self._path, problem)
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
                if not is_corruption(exc) or self._path is None:
                    raise CacheCorruptionError(
                        f"PerfDB {self._path or ':memory:'} failed: {exc}. If another process holds a long "
                        "write lock, raise busy_timeout_ms; if the disk is full, free space."
                    ) from exc
                self._conn.close()
                self._conn = None
                quarantine(self._path, f"{type(exc).__name__}: {exc}")
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
        values = tuple(getattr(rec, c) for c in COLUMNS)
        self._run(lambda c: c.execute(INSERT, values))
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
        sql = f"{SELECT} WHERE op = ? AND bucket = ? AND fingerprint = ? AND kernel_id = ?"
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
        sql = f"{SELECT} WHERE op = ? AND bucket = ? AND fingerprint = ?"
        rows = self._run(lambda c: c.execute(sql, args).fetchall())
        return {row[0]: PerfRecord(*row) for row in rows}

    def clear(self, op: str | None = None) -> int:
        """Delete every row (``op=None``) or the rows of one op; return how many rows were deleted.

        Raises:
            InvalidInputError: ``op`` is given but not a non-empty str.
        """
        if op is None:
            return self._run(lambda c: c.execute(f"DELETE FROM {TABLE}").rowcount)
        op = _check_key("op", op)
        return self._run(lambda c: c.execute(f"DELETE FROM {TABLE} WHERE op = ?", (op,)).rowcount)

    def __len__(self) -> int:
        """Number of rows, every op and fingerprint included."""
        return self._run(lambda c: c.execute(f"SELECT COUNT(*) FROM {TABLE}").fetchone()[0])

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
