"""benchmarks/engine/bench_structured.py runs end to end on the CPU (``--tiny``, 2 requests, 12 tokens) and
writes its JSON and markdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


def test_bench_structured_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # its checkpoint cache goes under ~/.cache
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "engine"))
    import bench_structured

    out = tmp_path / "out"
    argv = ["--tiny", "--out", str(out), "--requests", "2", "--max-tokens", "12", "--repeats", "1"]
    assert bench_structured.main(argv) == 0
    res = json.loads((out / "bench_structured.json").read_text())
    assert res["requests"] == 2 and res["backend"] == "xgrammar" and res["output_tokens"] > 0
    assert res["ratio"] > 0 and "| ratio |" in (out / "README.md").read_text()
    sys.modules.pop("bench_structured", None)
