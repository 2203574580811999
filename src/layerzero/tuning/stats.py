"""Pure functions of the tuning harness: outlier-robust statistics of timing samples, and the comparison of
a kernel's output with the reference kernel's (per-dtype tolerances)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from layerzero.core.errors import InvalidInputError, expected_got

__all__ = ["OUTLIER_MADS", "TOLERANCES", "SampleStats", "compare", "sample_stats"]

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
    torch.float64: 1e-7,
}
"""Largest allowed ``|out - ref| / (1 + |ref|)`` per output dtype (relative, with an absolute floor of the
same size for values below 1)."""

OUTLIER_MADS = 5.0
"""Samples above ``median + OUTLIER_MADS * MAD`` are dropped as outliers."""


@dataclass(frozen=True, slots=True)
class SampleStats:
    """Summary of timing samples (µs per call).

    Attributes:
        median_us: median of the kept samples (``numpy.median``).
        p95_us, p99_us: nearest-rank percentiles of the kept samples (``numpy.percentile(...,
            method="inverted_cdf")``, the PerfDB's definition).
        kept: the samples that survived outlier removal, in their original order, µs.
        outliers: how many samples were dropped.
    """

    median_us: float
    p95_us: float
    p99_us: float
    kept: tuple[float, ...]
    outliers: int


def sample_stats(samples_us: Sequence[float], *, mads: float = OUTLIER_MADS) -> SampleStats:
    """Drop outliers, then summarize (a pure function of the samples).

    A sample is an outlier when it is above ``median + mads * MAD``, where MAD is the median absolute
    deviation ``median(|x - median(x)|)`` (unscaled) of *all* samples. Only slow samples are dropped
    (preemption, page faults, clock ramps); fast ones are the signal. When MAD is 0 (at least half the
    samples equal the median, e.g. a coarse timer) nothing is dropped, so the tail stays visible.

    Raises:
        InvalidInputError: empty samples, a sample that is NaN, infinite or negative, or ``mads`` <= 0.
    """
    if isinstance(mads, bool) or not isinstance(mads, (int, float)) or not math.isfinite(mads) or mads <= 0:
        raise InvalidInputError(expected_got("sample_stats(mads)", "a finite number > 0", repr(mads)))
    try:
        x = np.asarray(list(samples_us), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            expected_got("sample_stats(samples_us)", "a sequence of numbers (µs)", type(samples_us).__name__)
        ) from exc
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)) or np.any(x < 0):
        raise InvalidInputError(
            expected_got(
                "sample_stats(samples_us)",
                "a non-empty 1-D sequence of finite timings >= 0 (µs)",
                repr(x.tolist()[:8]),
            )
        )
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med)))
    keep = x <= med + mads * mad if mad > 0 else np.ones(x.shape, dtype=bool)
    kept = x[keep]
    return SampleStats(
        median_us=float(np.median(kept)),
        p95_us=float(np.percentile(kept, 95, method="inverted_cdf")),
        p99_us=float(np.percentile(kept, 99, method="inverted_cdf")),
        kept=tuple(float(v) for v in kept),
        outliers=int(x.size - kept.size),
    )


def _flat(out: Any) -> list[Any]:
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in _flat(item)]
    return [out]


def compare(out: Any, ref: Any, tol: float | None = None) -> tuple[bool, float, str]:
    """Compare a kernel's output with the reference output: ``(ok, max_error, message)``.

    ``out``/``ref`` are tensors or (nested) tuples of tensors with the same structure, shapes and dtypes.
    Floating tensors: ``max_error = max |out - ref| / (1 + |ref|)`` (computed in float64; NaN must be NaN
    in both) must be <= ``tol`` (default: :data:`TOLERANCES` of the output dtype). Integer and bool tensors
    (sampled token ids) must be equal; other values must compare equal with ``==``.
    """
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs):
        return False, math.inf, expected_got("number of outputs", len(refs), len(outs))
    worst = 0.0
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if not isinstance(r, torch.Tensor):
            if o != r:
                return False, math.inf, expected_got(f"output {i}", repr(r), repr(o))
            continue
        if not isinstance(o, torch.Tensor) or o.shape != r.shape or o.dtype != r.dtype:
            got = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
            return False, math.inf, expected_got(f"output {i}", f"{tuple(r.shape)} {r.dtype}", got)
        if not r.is_floating_point():
            if not torch.equal(o, r):
                return False, math.inf, f"output {i}: {int((o != r).sum())} of {r.numel()} values differ"
            continue
        o64, r64 = o.detach().to(torch.float64), r.detach().to(torch.float64)
        nan_o, nan_r = torch.isnan(o64), torch.isnan(r64)
        if not torch.equal(nan_o, nan_r):
            return (
                False,
                math.inf,
                f"output {i}: NaN in {int(nan_o.sum())} places, reference {int(nan_r.sum())}",
            )
        err = ((o64 - r64).abs() / (1.0 + r64.abs())).masked_fill(nan_r, 0.0)
        e = float(err.max()) if err.numel() else 0.0
        e = math.inf if math.isnan(e) else e
        worst = max(worst, e)
        limit = TOLERANCES.get(r.dtype, 1e-4) if tol is None else tol
        if e > limit:
            return (
                False,
                worst,
                (f"output {i}: max |out - ref| / (1 + |ref|) = {e:.3g} > {limit:g} ({r.dtype} tolerance)"),
            )
    return True, worst, ""


SAMPLING_OPS = frozenset({"sample_topk", "sample_topp"})
_SUPPORT_SLACK = 1e-6
"""Relative slack at the top-k / nucleus boundary (float32 kernels vs this float64 check)."""


def check_sampled(op: str, tokens: Any, args: tuple[Any, ...]) -> tuple[bool, float, str]:
    """Check a sampling kernel's draw by *support*, not by equality with the reference's draw: every token of
    ``tokens`` ``[B]`` int64 must lie in the set the op allows for its row of ``logits`` ``[B, V]``: the
    argmax (temperature 0), the k most probable tokens (``sample_topk``; ties at the k-th probability
    allowed), or the nucleus (``sample_topp``: tokens whose cumulative probability before them, in
    descending order, is below p). Kernels may consume the ``torch.Generator`` differently (inverse CDF vs
    ``torch.multinomial``), so equal seeds need not give equal tokens across kernels.

    ``args`` are the canonical sampling args ``(logits, k or p, temperature, generator)``. Returns
    ``(ok, 0.0 or inf, message)`` like :func:`compare`.
    """
    logits, param, temperature = args[0], args[1], float(args[2])
    b, v = logits.shape
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tuple(tokens.shape) != (b,):
        got = (
            f"{tuple(tokens.shape)} {tokens.dtype}"
            if isinstance(tokens, torch.Tensor)
            else type(tokens).__name__
        )
        return False, math.inf, expected_got("sampled tokens", f"({b},) torch.int64", got)
    if bool(((tokens < 0) | (tokens >= v)).any()):
        return False, math.inf, f"sampled token ids outside [0, {v})"
    x = logits.detach().to(torch.float64)
    if temperature == 0.0:
        allowed = x == x.max(dim=-1, keepdim=True).values
    else:
        probs = torch.softmax(x / temperature, dim=-1)
        if op == "sample_topk":
            floor = probs.topk(min(int(param), v), dim=-1).values[:, -1:]
        else:
            desc = probs.sort(dim=-1, descending=True).values
            before = desc.cumsum(dim=-1) - desc
            kept = (before < float(param) + _SUPPORT_SLACK) | (torch.arange(v, device=x.device) == 0)
            floor = desc.masked_fill(~kept, math.inf).min(dim=-1, keepdim=True).values
        allowed = probs >= floor * (1.0 - _SUPPORT_SLACK)
    inside = allowed.gather(1, tokens.to(allowed.device)[:, None]).squeeze(1)
    if not bool(inside.all()):
        row = int((~inside).nonzero()[0, 0])
        return (
            False,
            math.inf,
            (
                f"{int((~inside).sum())} of {b} sampled tokens outside the {op} support, "
                f"e.g. row {row}: token {int(tokens[row])}"
            ),
        )
    return True, 0.0, ""
