"""Programmatic dependent launch (PDL) inside our ``@triton.jit`` kernels (private; imported by the kernel
modules, so only after ``import triton`` succeeded).

On Hopper and later a kernel launched with the PDL attribute (Triton's ``launch_pdl=True`` option) may start
while the kernel before it on the stream is still running: its launch and its programs' set-up overlap the
previous kernel's tail. A decode step of a small model is ~300 kernels of a few µs each in one CUDA graph, so
the gap between kernels is a large part of the step (``benchmarks/results/pdl_h200.md``). Correctness rests on
every PDL kernel waiting (``griddepcontrol.wait``: until the previous grid has completed and its writes are
visible) before it touches global memory: :func:`gdc_enter` at the very top of each kernel, so nothing it
reads or writes can race with the kernel before it. It then lets the next kernel launch early
(``griddepcontrol.launch_dependents``).

Exceptions, reads before the wait (each kernel names them): inputs that no kernel of a forward writes, or that
only the kernel just before it writes. Model weights (``triton.gemv``'s slab), RoPE's positions and cos / sin
tables, and a decode step's block tables and sequence lengths are written by no LayerZero kernel (step
metadata comes from the host or is copied before the step; a kernel that is not PDL-aware lets the next one
start only when it has completed). With the ``early_kv`` knob (off by default) ``triton.paged_decode``'s
batch-1 split kernel also reads the K / V of every position but each sequence's newest before its wait: in a
decode step only the newest position is written, by the KV write before the attention. A caller that writes
one of these with its own PDL-triggering kernel inside a captured step would race; copy them before the step,
as engines do.

Most kernels let the next one launch only after their own wait, so a kernel starts once every kernel two or
more launches back has completed. A few let it launch first (``gdc_enter``'s ``FIRST``: the batch-1 split
merge, ``PagedDecodeKnobs.trigger_first``; one-row prefetch GEMVs, ``GemvKnobs.trigger_first_rows``), so the
next projection's weight slab streams while they wait: its pre-wait reads then run beside several kernels
before it, which is still safe because they are only of the inputs above, and its wait still covers them all
(every kernel waits for the one before it before it completes, so one kernel's completion implies all earlier
ones'). Both instructions are no-ops in a kernel launched without the attribute. The host side (when to ask
for it) is ``_launch.pdl_kwargs``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def gdc_enter(PDL: tl.constexpr, FIRST: tl.constexpr = False):
    """First statement of a kernel that may be PDL-launched: with ``PDL``, wait for the previous grid, then
    let the next one launch; without, nothing (the interpreter has no such instructions). ``FIRST``: let the
    next one launch before the wait (see the module docstring: the next kernel's reads before its own wait
    then run beside the kernel before this one too)."""
    if PDL:
        if FIRST:
            gdc_launch_dependents()
        gdc_wait()
        if not FIRST:
            gdc_launch_dependents()
