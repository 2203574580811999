"""Tuning: measure kernels on given shapes and write the PerfDB that selection scores with.

``lz.tune(op, cases)`` (:func:`~layerzero.tuning.harness.tune`) checks every eligible kernel against the
reference kernel, times it, records the samples in the PerfDB and invalidates cached selections;
``layerzero tune`` is its command line. See docs/tuning.md.

Built on ``core`` and ``ops``; neither imports this package.
"""

from __future__ import annotations

from .harness import bind, time_kernel, tune
from .report import TuneReport, TuneRow, TuneStatus
from .shapes import SHAPE_DEFAULTS, make_inputs
from .stats import OUTLIER_MADS, TOLERANCES, SampleStats, compare, sample_stats

__all__ = [
    "OUTLIER_MADS",
    "SHAPE_DEFAULTS",
    "TOLERANCES",
    "SampleStats",
    "TuneReport",
    "TuneRow",
    "TuneStatus",
    "bind",
    "compare",
    "make_inputs",
    "sample_stats",
    "time_kernel",
    "tune",
]
