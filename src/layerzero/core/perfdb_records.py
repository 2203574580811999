"""PerfDB's records and their arithmetic: :class:`PerfRecord`, machine :func:`fingerprint`, sample statistics
(:func:`summarize_samples`) and the score term (:func:`perf_score`).

This is its own module because none of it touches SQLite: it is pure data and arithmetic, used by
:mod:`.perfdb` (which stores the records), by :mod:`.stores` and by the tuning and benchmark code that only
fingerprints a machine. :mod:`.perfdb` re-exports every name.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from layerzero.core.errors import InvalidInputError, expected_got

__all__ = ["PerfRecord", "fingerprint", "perf_score", "summarize_samples"]


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
