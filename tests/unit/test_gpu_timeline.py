"""``benchmarks/engine/gpu_timeline.summarize`` on a hand-made chrome trace: busy, idle, the gaps with the ops
either side, the busy time an overlapping op adds, and the per-step figure."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "engine"))

from gpu_timeline import summarize  # noqa: E402


def _k(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_summarize_hand_worked():
    # a [0, 10); b [8, 14) overlaps a by 2, adds 4; gap 14 -> 20 (6 µs); c [20, 30); gap 30 -> 130 (100 µs);
    # a [130, 140). Busy 10 + 4 + 10 + 10 = 34 µs, idle 106 µs, span 140 µs.
    events = [
        _k("a", 0, 10),
        _k("b", 8, 6),
        _k("c", 20, 10, "gpu_memcpy"),
        _k("a", 130, 10),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 3},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
    ]
    text = summarize(events, "two rounds", steps=2)
    assert "GPU timeline of two rounds" in text
    assert "span 0.1 ms over 4 GPU ops: busy 0.0 ms, idle 0.1 ms in 2 gaps" in text
    assert "2-10 µs 0.01 ms" in text and ">= 50 µs 0.10 ms" in text
    assert "| 100.0 | c | a |" in text and "| 6.0 | b | c |" in text
    assert text.index("| 100.0 |") < text.index("| 6.0 |")  # largest gap first
    # per op: a 2 calls of 10 µs adding 20 (10 per step); b adds 4 of its 6; per step = / 2
    assert "| a | 2 | 10.00 | 10.00 | 10.0 |" in text and "| b | 1 | 6.00 | 4.00 | 2.0 |" in text
    assert "| cudaLaunchKernel | 2 | 0.01 | 4.0 | 5.0 |" in text


def test_summarize_without_gpu_ops():
    assert "No GPU ops" in summarize([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])
