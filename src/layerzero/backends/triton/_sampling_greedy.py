"""``triton.sample_greedy`` (``lz.sample_greedy``): a split-vocabulary first argmax in the logits' own dtype,
chunk programs then one merge program a row (``_greedy_kernels``), with its chunk rule
(:func:`greedy_chunks`). Split from :mod:`.sampling` (the KernelSpecs and the inverse-CDF samplers), which
re-exports every name; the kernels are imported on the first call."""

from __future__ import annotations

import torch

from layerzero.core import knobs

from ._common import LazyModule, cdiv, next_pow2
from ._launch import launch_pinned, pdl_kwargs
from ._paged_common import sm_count
from ._sampling_knobs import KNOBS, SamplingKnobs, row_chunks

_GREEDY_KERNELS = LazyModule("_greedy_kernels")


def greedy_chunks(n_rows: int, vocab: int, programs: int, kn: SamplingKnobs | None = None) -> tuple[int, int]:
    """``(n_chunks, chunk_len)`` of :func:`sample_greedy`: each row is cut into ``n_chunks`` chunks of
    ``chunk_len`` columns (a whole number of ``greedy_block`` tiles; the last chunk shorter), about
    ``programs`` programs in all (at least one chunk a row, at most one a tile). ``n_chunks == 1`` means one
    program a row and no merge."""
    return row_chunks(n_rows, vocab, programs, (kn or knobs.get(KNOBS)).greedy_block)


def sample_greedy(logits: torch.Tensor, *, programs: int | None = None) -> torch.Tensor:
    """``lz.sample_greedy`` in Triton: per row the first index of the maximum, or of the first NaN when the
    row holds one (an all ``-inf`` row gives 0), as ``reference.sample_greedy`` defines it, reading the logits
    in their own dtype (no float32 copy).

    Args:
        logits: ``[S, V]`` float16/bfloat16/float32 on CUDA, any strides (a unit column stride is specialized,
            others are read strided, not copied); V below 2**31 - ``greedy_block``.
        programs: the number of chunk programs the split aims at (:func:`greedy_chunks`); None:
            ``greedy_programs_per_sm`` times the device's SMs. Every value gives the same ids.

    Returns:
        Token ids ``[S]``, int64 (a new ``torch.empty`` tensor).

    What runs where (``_greedy_kernels.py``): the ``(S, n_chunks)`` chunk programs, then one merge program a
    row over the chunks' partials (a float32 and an int32 ``[S, n_chunks]`` workspace, ``torch.empty``); with
    one chunk a row (``S >= programs`` or ``V <= greedy_block``) the chunk kernel writes the ids itself: one
    launch. No host synchronization, nothing drawn: graph-safe. PDL-launched inside captured graphs on SM >=
    9.0 for small batches (``_launch.pdl_kwargs``). ``S == 0`` launches nothing.

    Raises:
        Nothing of its own (``lz.sample_greedy`` validates).
    """
    n_rows, vocab = logits.shape
    out = torch.empty((n_rows,), dtype=torch.int64, device=logits.device)
    if n_rows == 0:
        return out
    mod = _GREEDY_KERNELS.get()
    kn = knobs.get(KNOBS)
    if programs is None:
        programs = kn.greedy_programs_per_sm * (
            sm_count(logits.device) if logits.is_cuda else kn.greedy_sms_off_gpu
        )
    n_chunks, chunk_len = greedy_chunks(n_rows, vocab, programs, kn)
    s_row, s_col = logits.stride()
    pdl = pdl_kwargs(logits, n_rows)
    block, direct = kn.greedy_block, n_chunks == 1
    # one pin per set of integer arguments and constexprs (launch_pinned's promise): tensors alone vary under
    # it
    pin = (s_row, s_col, vocab, chunk_len, n_chunks, block, bool(pdl))
    if direct:
        launch_pinned(
            mod._greedy_chunk,
            pin,
            (n_rows, 1),
            logits,
            out,
            out,
            out,
            s_row,
            s_col,
            vocab,
            chunk_len,
            1,
            BLOCK=block,
            CONTIG=s_col == 1,
            DIRECT=True,
            **pdl,
            num_warps=4,
        )
        return out
    pv = torch.empty((n_rows, n_chunks), dtype=torch.float32, device=logits.device)
    pi = torch.empty((n_rows, n_chunks), dtype=torch.int32, device=logits.device)
    launch_pinned(
        mod._greedy_chunk,
        pin,
        (n_rows, n_chunks),
        logits,
        pv,
        pi,
        out,
        s_row,
        s_col,
        vocab,
        chunk_len,
        n_chunks,
        BLOCK=block,
        CONTIG=s_col == 1,
        DIRECT=False,
        **pdl,
        num_warps=4,
    )
    chunks = next_pow2(cdiv(vocab, block))  # one compiled merge per vocabulary, whatever the batch
    launch_pinned(
        mod._greedy_merge,
        (n_chunks, chunks, bool(pdl)),
        (n_rows,),
        pv,
        pi,
        out,
        n_chunks,
        CHUNKS=chunks,
        **pdl,
        num_warps=1 if chunks <= 256 else 4,
    )
    return out
