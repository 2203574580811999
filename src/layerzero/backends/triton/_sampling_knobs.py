"""The knobs of the Triton samplers and the row-chunk rule they parametrize (pure Python, no triton):
:class:`SamplingKnobs` (registered here, as ``"triton.sampling"``, when :mod:`.sampling` imports this
module), :data:`GREEDY_BELOW` and :func:`row_chunks` (how ``lz.sample``'s split race and
``triton.sample_greedy`` cut a row into chunk programs). Split from :mod:`.sampling` (which re-exports every
name) so that each sampler family's module (``_sampling_race``, ``_sampling_greedy``) reads them without
importing the KernelSpecs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerzero.core import knobs
from layerzero.core.knobs import check_types, require

from ._common import cdiv, next_pow2

GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)
"""Temperatures below float32's smallest normal are greedy (as in ``lz.sample_*``): ``1 / T`` would
overflow."""
KNOBS = "triton.sampling"
"""The name :class:`SamplingKnobs` is registered under (``layerzero.core.knobs``)."""


@dataclass(frozen=True, slots=True)
class SamplingKnobs:
    """Tuning choices of the Triton samplers (tiles and split rules), registered as ``"triton.sampling"``;
    read once per call; measurements in ``benchmarks/results/knobs/triton_sampling.md``. Every value gives the
    same token ids. Raises ``ConfigurationError`` for a field of the wrong type or out of range."""

    block: int = 1024
    """Row tile of the inverse-CDF draw kernel (elements, a power of two); shorter rows use their next power
    of two."""
    race_block: int = 4096
    """Row tile of ``lz.sample``'s one-program-per-row race kernel (elements, a power of two)."""
    split_programs: int = 1056
    """:func:`sample` races ``B`` rows over ``ceil(split_programs / B)`` chunks a row (one program a row when
    that is one): eight programs per SM of an H100 / H200, up to 10x faster than a program a row at
    batch 1."""
    split_block: int = 2048
    """Row tile of the split-vocabulary race kernels (elements, a power of two); a chunk is a whole number of
    tiles."""
    greedy_block: int = 2048
    """Tile of ``triton.sample_greedy``'s chunk kernel (elements, a power of two: 16 a thread at 4 warps). Not
    tuned on a GPU yet."""
    greedy_programs_per_sm: int = 2
    """:func:`greedy_chunks` aims at this many chunk programs per SM: a batch-1 row over the whole GPU in one
    wave, a short vector for the merge. Not tuned on a GPU yet."""
    greedy_sms_off_gpu: int = 132
    """The SM count :func:`sample_greedy` assumes off CUDA (the CPU tests' interpreter): an H100 / H200's, so
    those tests split rows as those GPUs do."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("block", "race_block", "split_block", "greedy_block"):
            value = getattr(self, name)
            require(value >= 1 and next_pow2(value) == value, self, name, "a power of two >= 1")
        for name in ("split_programs", "greedy_programs_per_sm", "greedy_sms_off_gpu"):
            require(getattr(self, name) >= 1, self, name, "an int >= 1")


knobs.register(KNOBS, SamplingKnobs())


def row_chunks(n_rows: int, vocab: int, programs: int, block: int) -> tuple[int, int]:
    """``(n_chunks, chunk_len)``: each of ``n_rows`` rows of ``vocab`` columns cut into chunks of a whole
    number of ``block``-column tiles (the last chunk shorter), about ``programs`` chunks in all, at least one
    a row and at most one a tile; ``(1, vocab)`` when that leaves one chunk a row."""
    tiles = cdiv(vocab, block)
    want = min(tiles, cdiv(programs, max(n_rows, 1)))
    if want < 2:
        return 1, vocab
    per_chunk = cdiv(tiles, want)
    return cdiv(tiles, per_chunk), per_chunk * block
