"""The canary check behind ``lz.configure(canaries=True)`` (see ``layerzero/core/quarantine.py``): a kernel's
output on a key's first call against the op's reference kernel on the same inputs, with ``lz.tune``'s
comparison and per-dtype tolerances (``tuning/stats.compare``).

Not checked (None): sampling ops (random draws: ``lz.tune`` checks those statistically, over many draws), ops
that write their inputs in place (``reshape_and_cache``: the reference would see the kernel's writes), and
outputs the comparison cannot read. A reference kernel that raises is not the checked kernel's fault: not
checked either.
"""

from __future__ import annotations

from typing import Any

from layerzero.core.context import SelectionContext
from layerzero.core.dispatch import Runtime

from .autotune import reference_output
from .stats import compare

__all__ = ["UNCHECKED_OPS", "check"]

UNCHECKED_OPS = frozenset({"sample", "sample_topk", "sample_topp", "reshape_and_cache"})


def check(runtime: Runtime, ctx: SelectionContext, args: tuple[Any, ...], out: Any) -> str | None:
    """None when ``out`` (the chosen kernel's output for ``args``) matches the reference within tolerance, or
    cannot be checked; otherwise the mismatch, e.g. ``output 0: max |out - ref| / (1 + |ref|) = 0.5 >
    1e-05``."""
    if ctx.op in UNCHECKED_OPS or out is None:
        return None
    try:
        ref = reference_output(runtime, ctx, args)
    except Exception:  # noqa: BLE001 - the reference failing says nothing about the checked kernel
        return None
    ok, _, message = compare(out, ref)
    return None if ok else message
