"""Programmatic dependent launch (PDL) inside our ``@triton.jit`` kernels (private; imported by the kernel modules,
so only after ``import triton`` succeeded).

On Hopper and later a kernel launched with the PDL attribute (Triton's ``launch_pdl=True`` option) may start while
the kernel before it on the stream is still running: its launch and its programs' set-up overlap the previous
kernel's tail. A decode step of a small model is ~300 kernels of a few µs each in one CUDA graph, so the gap between
kernels is a large part of the step (``benchmarks/results/pdl_h200.md``). Correctness rests on every PDL kernel
waiting (``griddepcontrol.wait``: until the previous grid has completed and its writes are visible) before it
touches global memory: :func:`gdc_enter` at the very top of each kernel, so nothing it reads or writes can race
with the kernel before it. It then lets the next kernel launch early (``griddepcontrol.launch_dependents``).

Exceptions, reads before the wait (each kernel names them): inputs that the kernel just before cannot have written.
Every PDL kernel of ours waits before it lets the next one launch, so when a kernel starts, every kernel two or more
launches back has completed and its writes are visible; only the one just before may still run. Model weights
(``triton.gemv``'s slab, never written by a forward) and RoPE's positions and cos / sin tables are read before the wait: no LayerZero kernel writes them (step metadata
comes from the host or an earlier kernel; a kernel that is not PDL-aware lets the next one start only when it has
completed). A caller that writes one of these with its own PDL-triggering kernel right before the LayerZero call
inside a captured graph would race; copy them before the step, as engines do.
Both instructions are no-ops in a kernel launched without the attribute. The host side (when to ask for it) is
``_launch.pdl_kwargs``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def gdc_enter(PDL: tl.constexpr, FIRST: tl.constexpr = False):
    """First statement of a kernel that may be PDL-launched: with ``PDL``, wait for the previous grid, then let the
    next one launch; without, nothing (the interpreter has no such instructions). ``FIRST``: let the next one launch
    before the wait (an experiment, ``paged.TRIGGER_FIRST``: the next kernel's reads before its own wait may then run
    beside the kernel before this one too)."""
    if PDL:
        if FIRST:
            gdc_launch_dependents()
        gdc_wait()
        if not FIRST:
            gdc_launch_dependents()
