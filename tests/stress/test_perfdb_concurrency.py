"""PerfDB shared by several processes (WAL + busy timeout) and many threads at once."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from layerzero.core.perfdb import PerfDB

pytestmark = pytest.mark.stress

SRC = Path(__file__).resolve().parents[2] / "src"
FP = "0123456789abcdef"
N_PROC, N_ROWS = 3, 150

WORKER = """
import sys
from layerzero.core.perfdb import PerfDB
path, proc, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with PerfDB(path) as db:
    for i in range(n):
        db.record(f"p{proc}.k{i}", "attention", f"b{i % 5}", "0123456789abcdef", [float(proc), float(i), 1.0])
        db.for_bucket("attention", f"b{i % 5}", "0123456789abcdef")
        if i % 50 == 0:
            len(db)
"""


def test_processes_and_threads_share_one_file(tmp_path):
    path = tmp_path / "shared" / "perf.db"
    PerfDB(path).close()  # create it first so every worker opens the same schema
    pythonpath = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(path), str(p), str(N_ROWS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for p in range(N_PROC)
    ]
    errors: list[BaseException] = []

    def local_writer(t: int) -> None:
        try:
            with PerfDB(path) as db:
                for i in range(N_ROWS):
                    db.record(f"t{t}.k{i}", "attention", f"b{i % 5}", FP, [2.0, 4.0])
        except BaseException as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=local_writer, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
    assert not errors, errors

    with PerfDB(path) as db:
        assert len(db) == (N_PROC + 2) * N_ROWS
        assert db.lookup("p2.k149", "attention", "b4", FP).median_us == 2.0
        assert db.lookup("t1.k0", "attention", "b0", FP).median_us == 3.0
        per_bucket = [len(db.for_bucket("attention", f"b{j}", FP)) for j in range(5)]
        assert per_bucket == [(N_PROC + 2) * N_ROWS // 5] * 5
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    assert not list(path.parent.glob("*.corrupt-*"))
