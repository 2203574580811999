"""PerfDB's SQLite file: the table, its schema version, the connection pragmas, and what happens to a file
that is corrupt or of another version.

File format
    * one ``WITHOUT ROWID`` table ``perf_records`` whose primary key is the columns
      (op, bucket, fingerprint, kernel_id); that column order makes :meth:`PerfDB.for_bucket
      <layerzero.core.perfdb.PerfDB.for_bucket>` a prefix range scan of the primary key;
    * ``PRAGMA journal_mode=WAL``, ``PRAGMA busy_timeout`` and ``PRAGMA synchronous=NORMAL``;
    * ``PRAGMA user_version = SCHEMA_VERSION``; a file of another non-zero version is rebuilt, never
      migrated (:func:`validate_and_init`); a corrupt one is moved aside (:func:`quarantine`).

This is its own module because the file's layout and recovery (schema, "migration" by rebuild, integrity
checks, quarantine) are a concern apart from the statements :class:`~layerzero.core.perfdb.PerfDB` runs and
the locking around them; the full account is the docstring of :mod:`.perfdb`. WARNINGs are logged on the
``layerzero.core.perfdb`` logger, where they always were.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

from layerzero.core.errors import CacheCorruptionError, expected_got

logger = logging.getLogger("layerzero.core.perfdb")  # the documented logger of PerfDB's warnings

SCHEMA_VERSION = 1
"""Value of ``PRAGMA user_version`` this module writes; bump it whenever the table changes."""

TABLE = "perf_records"
COLUMNS = (
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
"""The columns of the table, in the order of :class:`~layerzero.core.perfdb_records.PerfRecord`'s fields."""
SCHEMA = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
    kernel_id TEXT NOT NULL, op TEXT NOT NULL, bucket TEXT NOT NULL, fingerprint TEXT NOT NULL,
    median_us REAL NOT NULL, p95_us REAL NOT NULL, variance_us2 REAL NOT NULL, samples INTEGER NOT NULL,
    created_at REAL NOT NULL, PRIMARY KEY (op, bucket, fingerprint, kernel_id)) WITHOUT ROWID"""
SELECT = f"SELECT {', '.join(COLUMNS)} FROM {TABLE}"
INSERT = f"INSERT OR REPLACE INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * 9)})"


def is_corruption(exc: BaseException) -> bool:
    """SQLITE_NOTADB / SQLITE_CORRUPT surface as DatabaseError; busy/locked/IO as OperationalError."""
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)


def connect(path: Path | None, busy_timeout_ms: int) -> sqlite3.Connection:
    """Open ``path`` (``None``: a private in-memory database) in autocommit mode with the busy timeout; a file
    also gets WAL (a WARNING when SQLite refuses it) and ``synchronous=NORMAL``."""
    target = ":memory:" if path is None else str(path)
    conn = sqlite3.connect(
        target, timeout=busy_timeout_ms / 1000.0, isolation_level=None, check_same_thread=False
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if path is not None:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                logger.warning(
                    "PerfDB %s: journal_mode is %r, not 'wal'; concurrent processes will "
                    "block each other more",
                    path,
                    mode,
                )
            conn.execute("PRAGMA synchronous = NORMAL")
        return conn
    except BaseException:
        conn.close()
        raise


def validate_and_init(conn: sqlite3.Connection, path: Path | None) -> str | None:
    """Create or check the schema; return a corruption reason, or None when the db is usable."""
    check = [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]
    if check != ["ok"]:
        return f"PRAGMA integrity_check reported {check[:5]!r}"
    if conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:  # usual case: no write lock
        return check_columns(conn)
    conn.execute("BEGIN IMMEDIATE")  # re-read under the write lock: another process may have built it
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        exists = (
            conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)).fetchone()
            is not None
        )
        if version != SCHEMA_VERSION:
            if exists or version != 0:
                logger.warning(
                    "PerfDB %s: schema version %s != %s; rebuilding the table empty "
                    "(timings are re-measured, not migrated)",
                    path,
                    version,
                    SCHEMA_VERSION,
                )
            conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
            conn.execute(SCHEMA)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return check_columns(conn)


def check_columns(conn: sqlite3.Connection) -> str | None:
    """None when the table has exactly the expected columns, else why not (a table of the wrong shape)."""
    cols = tuple(row[1] for row in conn.execute(f"PRAGMA table_info({TABLE})"))
    if sorted(cols) == sorted(COLUMNS):
        return None
    return expected_got(
        f"table {TABLE} (user_version {SCHEMA_VERSION})", f"columns {COLUMNS}", cols or "no such table"
    )


def quarantine(path: Path | None, reason: str) -> None:
    """Move the corrupt file (and its -wal/-shm) aside, then log a WARNING. File databases only."""
    if path is None:
        raise CacheCorruptionError(f"in-memory PerfDB is corrupt: {reason}. Create a new PerfDB().")
    base = f"{path}.corrupt-{int(time.time())}"
    dest, i = base, 1
    while os.path.exists(dest):
        dest, i = f"{base}.{i}", i + 1
    for src, dst in (
        (str(path), dest),
        (f"{path}-wal", f"{dest}-wal"),
        (f"{path}-shm", f"{dest}-shm"),
    ):
        try:
            os.replace(src, dst)
        except FileNotFoundError:  # absent, or another process quarantined it first
            pass
    logger.warning(
        "PerfDB %s is corrupt (%s); moved it to %s and rebuilt an empty database",
        path,
        reason,
        dest,
    )


__all__ = [
    "COLUMNS",
    "INSERT",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SELECT",
    "TABLE",
    "check_columns",
    "connect",
    "is_corruption",
    "quarantine",
    "validate_and_init",
]
