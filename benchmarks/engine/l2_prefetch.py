"""An experiment for batch-1 decode (not library code): bring the attention output and gate/up projections'
weights into L2 while the attention block runs, so those two GEMVs read L2 instead of HBM.

Why: at batch 1 a layer's attention (q/k norm + RoPE + KV write, the paged split and merge: ~6 µs on the H200)
reads ~1.5 MB of KV and leaves HBM mostly idle, while the projections after it stream 4.2 MB (o) and 12.6 MB
(gate/up) at 0.46-0.70 of the copy bandwidth (``benchmarks/results/gemv_prefetch_h200.md``). One small kernel
issuing Hopper's bulk L2 prefetch (``cp.async.bulk.prefetch.L2.global``, PTX ISA 8.0, sm_90: a hint, nothing
lands in registers and the issuing thread does not wait) right after the QKV projection could move those 16.8
MB during the attention block.

The kernel follows ``_gdc_kernels.py``'s protocol: it issues its prefetches (weights only: no kernel of a
forward writes them), then waits for the previous grid, then lets the next launch.
``benchmarks/engine/batch1_ab.py``'s ``l2-prefetch`` variant patches the engine's decoder layer to call
:func:`prefetch_l2` in captured decode steps of at most 4 sequences: measured 2026-11-28b, the graph 690 ->
828-831 µs (the attention block's small loads queued behind 16.8 MB of prefetch, and the prefetch kernel sat
on the critical path). The ``l2-side-o`` / ``l2-side-o-gu`` variants issue the prefetch from a parallel branch
of the graph instead (:class:`SideBranch`), of the o weight alone (4.2 MB) or of both: measured 2026-11-28g,
the graph 681-686 -> 687 / 830 µs (o) and 844 (both): slower too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzero.backends.triton._gdc_kernels import gdc_enter
from layerzero.backends.triton._launch import pdl_kwargs

SUB = 8192
"""Bytes one thread's bulk prefetch covers (a multiple of 16)."""
THREADS = 128
"""Prefetch instructions per program (one per thread of a 4-warp program)."""


@triton.jit
def _bulk_prefetch(ptr, nbytes):
    """``cp.async.bulk.prefetch.L2.global [ptr], nbytes`` for every element (nbytes a multiple of 16, > 0)."""
    return tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [ptr, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_two(
    A, a_bytes, B, b_bytes, THREADS: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr = False
):
    """Programs ``[0, cdiv(a_bytes, THREADS * SUB))`` prefetch tensor A's bytes, the rest B's; each thread one
    ``SUB``-byte range (the last one clipped; past the end, a 16-byte range at the start: harmless)."""
    pid = tl.program_id(0)
    per = THREADS * SUB
    a_progs = tl.cdiv(a_bytes, per)
    in_a = pid < a_progs
    base = tl.where(in_a, pid, pid - a_progs) * per + tl.arange(0, THREADS).to(tl.int64) * SUB
    total = tl.where(in_a, a_bytes, b_bytes)
    size = tl.minimum(total - base, SUB)
    ok = size > 0
    size = tl.where(ok, size // 16 * 16, 16).to(tl.int32)
    offs = tl.where(ok, base, 0)
    pa = A.to(tl.pointer_type(tl.int8)) + offs
    pb = B.to(tl.pointer_type(tl.int8)) + offs
    if in_a:
        _bulk_prefetch(pa, size)
    else:
        _bulk_prefetch(pb, size)
    gdc_enter(PDL)  # keeps the protocol: the next kernel launches once everything before this one completed


def prefetch_l2(a: torch.Tensor, b: torch.Tensor, *, pdl: bool = True) -> None:
    """Ask the GPU to bring tensors ``a`` and ``b`` (contiguous, CUDA, >= 16 bytes each; the same tensor twice
    for one) into L2, asynchronously; PDL-launched in captured decode steps like LayerZero's kernels
    (``pdl_kwargs``) unless ``pdl`` is False (a launch on a side stream, :class:`SideBranch`)."""
    per = THREADS * SUB
    a_bytes, b_bytes = a.numel() * a.element_size(), b.numel() * b.element_size()
    grid = (triton.cdiv(a_bytes, per) + triton.cdiv(b_bytes, per),)
    _prefetch_two[grid](
        a,
        a_bytes,
        b,
        b_bytes,
        THREADS=THREADS,
        SUB=SUB,
        num_warps=THREADS // 32,
        **(pdl_kwargs(a, 1) if pdl else {}),
    )


class SideBranch:
    """The prefetches on a side stream of a captured step: a parallel branch of the CUDA graph that forks
    after the kernel just enqueued (the QKV projection) and joins only at the end of the forward, so nothing
    on the main stream waits for it (the prefetch is a hint; no result depends on it). ``fork`` once per
    layer, ``join`` once per forward (every stream forked from a capturing stream must be joined before the
    capture ends). Measured slower (2026-11-28g: see the module docstring)."""

    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None
        self.forked = False

    def fork(self, *tensors: torch.Tensor) -> None:
        """Prefetch ``tensors`` (one or two) into L2 on the side stream, after what the current stream
        enqueued."""
        main = torch.cuda.current_stream()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=main.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            prefetch_l2(tensors[0], tensors[-1], pdl=False)
        self.forked = True

    def join(self) -> None:
        """Make the current stream wait for the side stream's prefetches (no-op when nothing was forked)."""
        if self.forked and self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        self.forked = False
