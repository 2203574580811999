"""Programmatic dependent launch (PDL) inside our ``@triton.jit`` kernels (private; imported by the kernel modules,
so only after ``import triton`` succeeded).

On Hopper and later a kernel launched with the PDL attribute (Triton's ``launch_pdl=True`` option) may start while
the kernel before it on the stream is still running: its launch and its programs' set-up overlap the previous
kernel's tail. A decode step of a small model is ~300 kernels of a few µs each in one CUDA graph, so the gap between
kernels is a large part of the step (``benchmarks/results/pdl_h200.md``). Correctness rests on every PDL kernel
waiting (``griddepcontrol.wait``: until the previous grid has completed and its writes are visible) before it
touches global memory: :func:`gdc_enter` at the very top of each kernel, so nothing it reads or writes can race
with the kernel before it. It then lets the next kernel launch early (``griddepcontrol.launch_dependents``).
Both instructions are no-ops in a kernel launched without the attribute. The host side (when to ask for it) is
``_launch.pdl_kwargs``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def gdc_enter(PDL: tl.constexpr):
    """First statement of a kernel that may be PDL-launched: with ``PDL``, wait for the previous grid, then let the
    next one launch; without, nothing (the interpreter has no such instructions)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
