"""PerfDB: round trip, statistics against numpy, fingerprint isolation, format, quarantine, threads."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sqlite3
import threading
import time

import numpy as np
import pytest

from layerzero.core import perfdb_schema
from layerzero.core.errors import CacheCorruptionError, ConfigurationError, InvalidInputError
from layerzero.core.perfdb import (
    SCHEMA_VERSION,
    PerfDB,
    PerfRecord,
    fingerprint,
    perf_score,
    summarize_samples,
)

pytestmark = pytest.mark.unit

FP = "0123456789abcdef"
FP2 = "fedcba9876543210"
LOGGER = "layerzero.core.perfdb"


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def db(tmp_path):
    with PerfDB(tmp_path / "perf.db", clock=FakeClock()) as d:
        yield d


def _pragma(path, name):
    conn = sqlite3.connect(path)
    try:
        return conn.execute(f"PRAGMA {name}").fetchone()[0]
    finally:
        conn.close()


# ------------------------------------------------------------------------------------ statistics
@pytest.mark.parametrize(
    ("samples", "median", "p95", "var"),
    [
        ([10.0], 10.0, 10.0, 0.0),
        ([1.0, 2.0, 3.0, 4.0], 2.5, 4.0, 1.25),  # p95 rank ceil(3.8) = 4; mean 2.5
        ([3.0, 1.0, 2.0], 2.0, 3.0, 2.0 / 3.0),  # unsorted input
        ([float(i) for i in range(1, 21)], 10.5, 19.0, 33.25),  # rank ceil(0.95*20) = 19: exact, not 20
        ([5.0, 5.0, 5.0, 0.0], 5.0, 5.0, 4.6875),
    ],
)
def test_summary_hand_worked(samples, median, p95, var):
    m, p, v, n = summarize_samples(samples)
    assert (m, p, n) == (median, p95, len(samples))
    assert v == pytest.approx(var, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 19, 20, 21, 40, 99, 100, 101, 257])
def test_summary_matches_numpy(n):
    rng = np.random.default_rng(n)
    x = rng.lognormal(mean=3.0, sigma=0.5, size=n)
    x[rng.integers(0, n, size=n // 3)] = x[0]  # ties
    m, p, v, count = summarize_samples(x.tolist())
    assert count == n
    assert m == pytest.approx(float(np.median(x)), rel=1e-15)
    assert p == float(np.percentile(x, 95, method="inverted_cdf"))
    assert v == pytest.approx(float(np.var(x.astype(np.float64))), rel=1e-10, abs=1e-12)


def test_summary_accepts_numpy_and_ints():
    assert summarize_samples(np.array([4, 2, 6], dtype=np.float32))[:2] == (4.0, 6.0)
    assert summarize_samples((1, 3))[0] == 2.0


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([], "at least one sample"),
        ([1.0, float("nan")], r"samples_us\[1\].*finite"),
        ([1.0, float("inf")], r"samples_us\[1\].*finite"),
        ([-0.5], r"samples_us\[0\].*>= 0"),
        (["1.0"], r"samples_us\[0\].*real number"),
        ([True], r"samples_us\[0\].*real number"),
        ("123", "sequence of timings"),
        (12.0, "sequence of timings"),
    ],
)
def test_record_rejects_bad_samples(db, samples, match):
    with pytest.raises(InvalidInputError, match=match):
        db.record("k.a", "attention", "b", FP, samples)
    assert len(db) == 0


@pytest.mark.parametrize("field", ["kernel_id", "op", "bucket", "fingerprint"])
@pytest.mark.parametrize("bad", ["", None, 3])
def test_record_rejects_bad_keys(db, field, bad):
    args = {"kernel_id": "k.a", "op": "attention", "bucket": "b", "fingerprint": FP}
    args[field] = bad
    with pytest.raises(InvalidInputError, match=f"{field}: expected a non-empty str"):
        db.record(samples_us=[1.0], **args)


# ------------------------------------------------------------------------------------ round trip
def test_round_trip_and_upsert(tmp_path):
    clock = FakeClock(1000.0)
    path = tmp_path / "a" / "b" / "perf.db"  # parent dirs do not exist yet
    with PerfDB(path, clock=clock) as d:
        assert d.path == path
        rec = d.record("torch_sdpa.flash", "attention", "s128_d64", FP, [3.0, 1.0, 2.0])
        assert rec == PerfRecord(
            "torch_sdpa.flash", "attention", "s128_d64", FP, 2.0, 3.0, 2.0 / 3.0, 3, 1000.0
        )
        assert d.lookup("torch_sdpa.flash", "attention", "s128_d64", FP) == rec
        clock.t = 2000.0
        rec2 = d.record("torch_sdpa.flash", "attention", "s128_d64", FP, [7.0])  # replaces, not merges
        assert len(d) == 1
    with PerfDB(path) as d:  # persisted
        assert d.lookup("torch_sdpa.flash", "attention", "s128_d64", FP) == rec2
        assert rec2.created_at == 2000.0 and rec2.samples == 1 and rec2.median_us == 7.0


def test_lookup_missing_and_fingerprint_isolation(db):
    db.record("k.a", "attention", "b1", FP, [1.0])
    assert db.lookup("k.a", "attention", "b1", FP2) is None
    assert db.lookup("k.a", "attention", "b2", FP) is None
    assert db.lookup("k.a", "rms_norm", "b1", FP) is None
    assert db.lookup("k.b", "attention", "b1", FP) is None
    assert db.for_bucket("attention", "b1", FP2) == {}
    db.record("k.a", "attention", "b1", FP2, [9.0])  # same key, other machine: a separate row
    assert len(db) == 2
    assert db.lookup("k.a", "attention", "b1", FP).median_us == 1.0
    assert db.lookup("k.a", "attention", "b1", FP2).median_us == 9.0


def test_for_bucket_selects_exactly_the_bucket(db):
    expected = {
        k: db.record(k, "attention", "b1", FP, [float(i + 1)]) for i, k in enumerate(["x.a", "y.b", "z.c"])
    }
    db.record("x.a", "attention", "b2", FP, [5.0])
    db.record("x.a", "rms_norm", "b1", FP, [5.0])
    db.record("w.d", "attention", "b1", FP2, [5.0])
    assert db.for_bucket("attention", "b1", FP) == expected
    assert list(db.for_bucket("attention", "b2", FP)) == ["x.a"]


def test_for_bucket_is_one_indexed_select(db):
    sql = f"{perfdb_schema.SELECT} WHERE op = ? AND bucket = ? AND fingerprint = ?"
    plan = db._run(lambda c: c.execute("EXPLAIN QUERY PLAN " + sql, ("attention", "b", FP)).fetchall())
    details = " | ".join(row[-1] for row in plan)
    assert "USING PRIMARY KEY" in details and "SCAN" not in details, details


def test_clear_and_len(db):
    for k in ("k.a", "k.b"):
        db.record(k, "attention", "b", FP, [1.0])
    db.record("k.a", "rms_norm", "b", FP, [1.0])
    assert len(db) == 3
    assert db.clear("rope") == 0
    assert db.clear("attention") == 2
    assert len(db) == 1
    assert db.clear() == 1
    assert len(db) == 0
    with pytest.raises(InvalidInputError, match="op: expected a non-empty str"):
        db.clear("")


def test_close_is_idempotent_and_later_calls_raise(tmp_path):
    d = PerfDB(tmp_path / "p.db")
    d.close()
    d.close()
    with pytest.raises(ConfigurationError, match="expected an open database, got a closed one"):
        d.lookup("k.a", "attention", "b", FP)
    with PerfDB(tmp_path / "q.db") as d2:
        pass
    with pytest.raises(ConfigurationError, match="closed"):
        len(d2)


def test_in_memory_db():
    with PerfDB() as d:
        assert d.path is None
        d.record("k.a", "attention", "b", FP, [1.0, 2.0])
        assert d.lookup("k.a", "attention", "b", FP).median_us == 1.5
    with PerfDB() as other:  # private: nothing shared between in-memory instances
        assert len(other) == 0


def test_unopenable_path_raises_configuration_error(tmp_path):
    with pytest.raises(ConfigurationError, match="writable SQLite file path"):
        PerfDB(tmp_path)  # a directory
    with pytest.raises(ConfigurationError, match="busy_timeout_ms"):
        PerfDB(None, busy_timeout_ms=-1)


# --------------------------------------------------------------------------------- file format
def test_wal_and_user_version(db):
    db.record("k.a", "attention", "b", FP, [1.0])
    assert _pragma(db.path, "journal_mode") == "wal"
    assert _pragma(db.path, "user_version") == SCHEMA_VERSION == 1


def test_other_schema_version_is_rebuilt_keeping_other_tables(tmp_path, caplog):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE perf_records (kernel_id TEXT, time_ms REAL)")
    conn.execute("INSERT INTO perf_records VALUES ('k.a', 1.0)")
    conn.execute("CREATE TABLE keep_me (x INTEGER)")
    conn.execute("INSERT INTO keep_me VALUES (42)")
    conn.execute("PRAGMA user_version = 7")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger=LOGGER), PerfDB(path) as d:
        assert len(d) == 0
        d.record("k.a", "attention", "b", FP, [1.0])
        assert d.lookup("k.a", "attention", "b", FP) is not None
    assert "schema version 7 != 1" in caplog.text
    assert _pragma(path, "user_version") == 1
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT x FROM keep_me").fetchall() == [(42,)]
    conn.close()
    assert not list(tmp_path.glob("old.db.corrupt-*"))


# ---------------------------------------------------------------------------------- quarantine
def _quarantined(path):
    found = path.parent.glob(path.name + ".corrupt-*")
    return sorted(p for p in found if not p.name.endswith(("-wal", "-shm")))


def test_garbage_file_is_quarantined_and_rebuilt(tmp_path, caplog):
    path = tmp_path / "perf.db"
    garbage = b"this is not a sqlite database\x00\xff" * 200
    path.write_bytes(garbage)
    before = int(time.time())
    with caplog.at_level(logging.WARNING, logger=LOGGER), PerfDB(path) as d:
        assert len(d) == 0
        d.record("k.a", "attention", "b", FP, [2.0])
        assert d.lookup("k.a", "attention", "b", FP).median_us == 2.0
    moved = _quarantined(path)
    assert len(moved) == 1
    assert moved[0].read_bytes() == garbage
    assert before <= int(moved[0].name.rsplit("-", 1)[1]) <= int(time.time())
    assert "is corrupt" in caplog.text and str(moved[0]) in caplog.text
    assert _pragma(path, "journal_mode") == "wal"


def test_corrupt_pages_fail_integrity_check_and_are_quarantined(tmp_path, caplog):
    path = tmp_path / "perf.db"
    with PerfDB(path) as d:
        for i in range(300):
            d.record(f"k.{i}", "attention", f"bucket-{i}", FP, [float(i)])
    data = bytearray(path.read_bytes())
    assert len(data) > 3 * 4096 and data[:16] == b"SQLite format 3\x00"
    data[4096 + 100 : len(data) - 100] = b"\xa5" * (len(data) - 4096 - 200)  # keep the header page
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=LOGGER), PerfDB(path) as d:
        assert len(d) == 0
    assert len(_quarantined(path)) == 1
    assert "is corrupt" in caplog.text


def test_broken_schema_with_current_version_is_quarantined(tmp_path, caplog):
    path = tmp_path / "perf.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE perf_records (kernel_id TEXT)")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.commit()
    conn.close()
    with caplog.at_level(logging.WARNING, logger=LOGGER), PerfDB(path) as d:
        d.record("k.a", "attention", "b", FP, [1.0])
        assert len(d) == 1
    assert len(_quarantined(path)) == 1
    assert "columns" in caplog.text


class _CorruptOnce:
    """Connection stand-in whose next execute() reports corruption, as SQLite does mid-run."""

    def __init__(self, real: sqlite3.Connection) -> None:
        self.real = real

    def execute(self, *args):
        raise sqlite3.DatabaseError("database disk image is malformed")

    def close(self) -> None:
        self.real.close()


def test_corruption_found_mid_run_quarantines_and_retries(tmp_path, caplog):
    path = tmp_path / "perf.db"
    with PerfDB(path) as d:
        d.record("k.a", "attention", "b", FP, [1.0])
        d._conn = _CorruptOnce(d._conn)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert d.lookup("k.a", "attention", "b", FP) is None  # answered by the rebuilt db
        d.record("k.b", "attention", "b", FP, [1.0])
        assert list(d.for_bucket("attention", "b", FP)) == ["k.b"]
    assert len(_quarantined(path)) == 1
    assert "malformed" in caplog.text


def test_in_memory_corruption_raises_typed_error():
    with PerfDB() as d:
        real = d._conn
        d._conn = _CorruptOnce(real)
        with pytest.raises(CacheCorruptionError, match="malformed"):
            len(d)
        d._conn = real


# ------------------------------------------------------------------------------- fingerprint
def test_fingerprint_canonical_form_and_order_independence():
    parts = {
        "device": "NVIDIA H100 80GB HBM3",
        "sm": "9.0",
        "driver": "550.54.15",
        "cuda": "12.4",
        "torch": "2.5.1",
    }
    canonical = (
        '[["cuda","12.4"],["device","NVIDIA H100 80GB HBM3"],["driver","550.54.15"],'
        '["sm","9.0"],["torch","2.5.1"]]'
    )
    expected = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert fingerprint(parts) == expected == "4bb3df18ec58b8cb"
    assert fingerprint(dict(reversed(parts.items()))) == expected
    for key in parts:
        assert fingerprint({**parts, key: parts[key] + "x"}) != expected
    assert fingerprint({**parts, "flash_attn": "2.6.3"}) != expected
    assert fingerprint({"a=b": "c"}) != fingerprint({"a": "b=c"})
    assert fingerprint({"a": "b,c"}) != fingerprint({"a": "b", "c": ""})


@pytest.mark.parametrize(
    ("parts", "match"),
    [
        ({"sm": 9.0}, r"item 'sm'.*str keys and str values, got str -> float"),
        ({1: "x"}, r"str keys and str values"),
        ([("sm", "9.0")], r"Mapping\[str, str\], got list"),
    ],
)
def test_fingerprint_rejects_bad_parts(parts, match):
    with pytest.raises(InvalidInputError, match=match):
        fingerprint(parts)


# --------------------------------------------------------------------------------- perf_score
def _rec(kernel_id: str, median: float) -> PerfRecord:
    return PerfRecord(kernel_id, "attention", "b", FP, median, median, 0.0, 1, 0.0)


def test_perf_score_hand_worked():
    recs = {"a": _rec("a", 10.0), "b": _rec("b", 20.0), "c": _rec("c", 40.0)}
    assert perf_score(recs, "a") == 1000.0
    assert perf_score(recs, "b") == 500.0
    assert perf_score(recs, "c") == 250.0
    assert perf_score(recs, "unmeasured") == 0.0
    assert perf_score(recs, "b", weight=2.0) == 1.0
    assert perf_score({}, "a") == 0.0
    zero = {"a": _rec("a", 0.0), "b": _rec("b", 5.0)}
    assert perf_score(zero, "a") == 1000.0
    assert perf_score(zero, "b") == 0.0


@pytest.mark.parametrize("weight", [-1.0, math.nan, math.inf, "1000"])
def test_perf_score_rejects_bad_weight(weight):
    with pytest.raises(InvalidInputError, match="perf_score.weight.: expected a finite number >= 0"):
        perf_score({"a": _rec("a", 1.0)}, "a", weight=weight)


# ---------------------------------------------------------------------------------- threads
def test_concurrent_writers_from_threads(tmp_path):
    path = tmp_path / "perf.db"
    shared = PerfDB(path)
    others = [PerfDB(path) for _ in range(2)]  # separate connections to the same file
    dbs = [shared, shared, *others]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(dbs))

    def work(t: int, d: PerfDB) -> None:
        try:
            barrier.wait()
            for i in range(40):
                d.record(f"k{t}.{i}", "attention", f"b{i % 4}", FP, [float(t), float(i)])
                d.for_bucket("attention", f"b{i % 4}", FP)
        except BaseException as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t, d)) for t, d in enumerate(dbs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    for d in dbs:
        d.close()
    assert not errors, errors
    with PerfDB(path) as d:
        assert len(d) == len(dbs) * 40
        assert d.lookup("k3.39", "attention", "b3", FP).median_us == 21.0
        assert sum(len(d.for_bucket("attention", f"b{j}", FP)) for j in range(4)) == len(dbs) * 40


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")
def test_forked_child_reopens_its_own_connection(tmp_path):
    path = tmp_path / "perf.db"
    with PerfDB(path) as d:
        d.record("parent.a", "attention", "b", FP, [1.0])
        pid = os.fork()
        if pid == 0:  # child: must not reuse the parent's connection
            code = 1
            try:
                d.record("child.a", "attention", "b", FP, [2.0])
                code = 0 if d._inherited is not None and len(d) == 2 else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert d._inherited is None  # the parent kept its own connection
        assert sorted(d.for_bucket("attention", "b", FP)) == ["child.a", "parent.a"]
        d.record("parent.b", "attention", "b", FP, [3.0])
        assert len(d) == 3
