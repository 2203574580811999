"""Smoke test of ``benchmarks/engine/bench_sampling_settings.py --tiny`` (a tiny dummy-weight llama on the
CPU, a few requests, three settings): it runs, both rounds time every setting, all-greedy's ratio is 1, and
the JSON and markdown results name the machine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "engine" / "bench_sampling_settings.py"


def test_tiny_run_writes_the_table(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_sampling_settings", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    only = ["+ top_p 0.95", "presence_penalty 0.3"]
    res = mod.main(["--tiny", "--num-prompts", "3", "--out", str(tmp_path), "--only", *only])
    rows = {r["setting"]: r for r in res["rows"]}
    assert set(rows) == {"all-greedy", *only}
    assert rows["all-greedy"]["ratio_to_greedy"] == pytest.approx(1.0)
    assert all(len(r["tok_s_rounds"]) == 2 and min(r["tok_s_rounds"]) > 0 for r in rows.values())
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["machine"]["torch"] and saved["rows"] == res["rows"]
    md = (tmp_path / "results.md").read_text()
    assert "| presence_penalty 0.3 |" in md and "cpu_flags" in md
