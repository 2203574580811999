"""``triton.sample`` (``lz.sample``): the exponential race fused in Triton, as one program per row
(``_sampling_kernels._race_row``) or, for few rows, over vocabulary chunks (``_sampling_split_kernels``:
chunk maxima, the race over each chunk, the merge), with the chunk rule (:func:`split_chunks`,
:func:`chunk_pad`). Split from :mod:`.sampling` (the KernelSpecs and the inverse-CDF samplers), which
re-exports every name; the kernels are imported on the first call."""

from __future__ import annotations

import torch

from layerzero.core import knobs

from ._common import LazyModule, cdiv, next_pow2
from ._launch import launch
from ._sampling_knobs import GREEDY_BELOW, KNOBS, SamplingKnobs, row_chunks

_KERNELS = LazyModule("_sampling_kernels")
_SPLIT_KERNELS = LazyModule("_sampling_split_kernels")
_REJECT_KERNELS = LazyModule("_sampling_reject_kernels")


def split_chunks(n_rows: int, vocab: int, kn: SamplingKnobs | None = None) -> tuple[int, int]:
    """``(n_chunks, chunk_len)`` of :func:`sample`'s split path by the ``split_programs`` rule (``kn``: the
    knobs, default those in force): ``n_chunks == 1`` means one program per row (``_race_row``). ``chunk_len``
    is a whole number of ``split_block`` tiles."""
    kn = kn or knobs.get(KNOBS)
    return row_chunks(n_rows, vocab, kn.split_programs, kn.split_block)


def chunk_pad(vocab: int, kn: SamplingKnobs | None = None) -> int:
    """The split kernels' compile-time chunk-vector width for a ``vocab``-column row: the next power of two of
    the most chunks any batch size gives that vocabulary (one per ``split_block`` tile), so every batch size
    runs one compiled variant (a width that changed with the batch compiled variants inside the engine's timed
    runs)."""
    return next_pow2(cdiv(vocab, (kn or knobs.get(KNOBS)).split_block))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    split: bool | None = None,
) -> torch.Tensor:
    """``lz.sample`` with the exponential race fused in Triton: the semantics of ``reference.sample`` (vLLM v1
    ``Sampler``, HF warper order), whose docstring gives them.

    Args:
        logits: ``[B, V]`` float16/bfloat16/float32 on CUDA (float32 math).
        temperature, top_k, top_p, min_p, seeds, offsets: ``[B]`` per-row tensors or None, as ``lz.sample``.
        generator: CUDA ``torch.Generator`` or None (the device's default): one int64 per call is drawn from
            it (``torch.randint``, on the device: no host synchronization) as the noise seed of unseeded rows.
        split: None (default) picks the path by the ``split_programs`` rule (:func:`split_chunks`); True
            forces the split-vocabulary path with the chunks of a one-row batch (one program per row still
            when the row fits one ``split_block`` tile), False the one-program-per-row kernel. Both give the
            same token ids.

    Returns:
        Token ids ``[B]``, int64.

    What runs where: without top-k / top-p, only Triton kernels. Few rows (``B < split_programs`` with
    ``V > split_block``; decode batches): three launches over ``(B, chunks)`` / ``(B, chunks)`` / ``(B,)``
    programs (``_sampling_split_kernels.py``: chunk maxima; row max then the race over each chunk; the merge),
    with two ``[B, 2, chunks]`` partial buffers; many rows: one launch of ``_race_row``, one program per row,
    two reads of the row. The split path returns exactly ``_race_row``'s ids (same scores, the smallest column
    among equal maxima). The reference makes about a dozen ``[B, V]`` passes. With top-k or top-p: no sort,
    one launch of ``_sampling_reject_kernels._reject_row`` (one program per row): pivot rejection over the
    same race, each round one read of the row (that module's docstring gives the algorithm); the accepted
    token is the race's argmax over the kept set, the reference's sort-and-cut token up to float32 rounding at
    a cut's boundary. Rows with both top-k and top-p first find their k-th value by a radix select over the
    float keys (four 256-bin histogram passes: the top-k mass the top-p cut is relative to). Seeded rows
    (``seed >= 0``) draw the reference's counter-based noise, so they pick the reference's token up to float32
    rounding of ``z`` and of the logarithms (near-ties only); unseeded rows draw the same noise hashed from
    the call's random seed and their row index instead of ``torch.exponential_`` (same distribution, another
    stream). The min-p cut is ``exp(z) < min_p`` (``prob / max prob`` without the softmax sum; the reference
    rounds the normalized probabilities, which can differ exactly at the boundary). No host synchronization on
    either path; every buffer is a ``torch.empty`` on the current stream.

    Raises:
        Nothing of its own (``lz.sample`` validates).
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_rows, vocab = logits.shape
    if seeds is not None and offsets is None:
        offsets = torch.zeros_like(seeds)
    base = torch.randint(0, 1 << 62, (1,), generator=generator, device=logits.device, dtype=torch.int64)
    out = torch.empty((n_rows,), dtype=torch.int64, device=logits.device)
    dummy = out  # a pointer for absent tensors (their HAS_* flag keeps the kernel from reading it)
    t_arg = temperature if temperature is not None else dummy
    rest = (
        min_p if min_p is not None else dummy,
        seeds if seeds is not None else dummy,
        offsets if offsets is not None else dummy,
        base,
    )
    flags = dict(HAS_T=temperature is not None, HAS_MINP=min_p is not None, HAS_SEEDS=seeds is not None)
    tiny = float(torch.finfo(torch.float32).tiny)
    kn = knobs.get(KNOBS)
    if (top_k is not None or top_p is not None) and n_rows:
        launch(
            _REJECT_KERNELS.get()._reject_row,
            (n_rows,),
            logits,
            t_arg,
            top_k if top_k is not None else dummy,
            top_p if top_p is not None else dummy,
            *rest,
            out,
            logits.stride(0),
            vocab,
            GREEDY_BELOW,
            tiny,
            HAS_K=top_k is not None,
            HAS_P=top_p is not None,
            **flags,
            BLOCK=min(kn.race_block, next_pow2(vocab)),
            num_warps=8,
        )
        return out
    n_chunks, chunk_len = (
        (1, vocab) if split is False or n_rows == 0 else split_chunks(1 if split else n_rows, vocab, kn)
    )
    if n_chunks > 1:
        mod = _SPLIT_KERNELS.get()
        fp = torch.empty((n_rows, 2, n_chunks), dtype=torch.float32, device=logits.device)
        ip = torch.empty((n_rows, 2, n_chunks), dtype=torch.int32, device=logits.device)
        chunks = chunk_pad(vocab, kn)
        launch(
            mod._split_max,
            (n_rows, n_chunks),
            logits,
            fp,
            ip,
            logits.stride(0),
            vocab,
            chunk_len,
            n_chunks,
            BLOCK=kn.split_block,
            num_warps=4,
        )
        launch(
            mod._split_race,
            (n_rows, n_chunks),
            logits,
            t_arg,
            *rest,
            fp,
            ip,
            logits.stride(0),
            vocab,
            chunk_len,
            n_chunks,
            GREEDY_BELOW,
            tiny,
            **flags,
            BLOCK=kn.split_block,
            CHUNKS=chunks,
            num_warps=4,
        )
        launch(
            mod._split_merge,
            (n_rows,),
            t_arg,
            fp,
            ip,
            out,
            n_chunks,
            GREEDY_BELOW,
            HAS_T=temperature is not None,
            CHUNKS=chunks,
            num_warps=1 if chunks <= 128 else 4,
        )
    else:
        launch(
            _KERNELS.get()._race_row,
            (n_rows,),
            logits,
            t_arg,
            *rest,
            out,
            logits.stride(0),
            vocab,
            GREEDY_BELOW,
            tiny,
            **flags,
            BLOCK=min(kn.race_block, next_pow2(vocab)),
            num_warps=8,
        )
    return out
