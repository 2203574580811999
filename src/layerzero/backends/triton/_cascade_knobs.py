"""The knobs of ``triton.paged_prefill_lse`` / ``triton.paged_prefill`` and the launch choices they decide
(pure Python, no triton): :class:`CascadeKnobs` (registered here, as ``"triton.cascade"``, when
:mod:`.cascade` imports this module), :func:`prefill_launch` (a call's tile height, warps, stages, split bound
and programs per SM) and :func:`seq_pad` (the per-sequence vectors' width). Split from :mod:`.cascade` (which
re-exports every name) to keep that module under its size limit; the kernel's hard limits (:data:`MAX_SEQS`
here, ``MAX_GROUP`` and ``HEAD_DIM_MAX`` there) are constants, not knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from layerzero.core import knobs
from layerzero.core.knobs import check_types, require

from ._common import next_pow2

MAX_SEQS = 2048
"""Sequences per call: every program holds per-sequence vectors of :func:`seq_pad` entries to find its work
items."""
ROWS_FEW_MAX_TOKENS = 2
"""A call with at most this many query tokens per sequence on average takes ``rows_few``-row tiles."""
KNOBS = "triton.cascade"
"""The name :class:`CascadeKnobs` is registered under (``layerzero.core.knobs``)."""


@dataclass(frozen=True, slots=True)
class CascadeKnobs:
    """Tuning choices of ``triton.paged_prefill_lse`` / ``triton.paged_prefill``, registered as
    ``"triton.cascade"``: defaults from H200 runs (``benchmarks/results/knobs/triton_cascade.md``), read once
    per call (:func:`prefill_launch`, :func:`seq_pad`). Raises ``ConfigurationError`` for a field of the wrong
    type or out of range."""

    rows: int = 64
    """Query rows (tokens x GQA group) per tile when sequences have many query tokens (prefill)."""
    rows_few: int = 16
    """Query rows per tile when the call has at most two query tokens per sequence on average (cascade's
    shared level: a few members' decode queries a tile, where 64 rows would be mostly padding)."""
    max_splits: int = 16
    """Most KV splits per sequence (the merge holds them in one tile)."""
    workspace_bytes: int = 32 << 20
    """Bytes split-K's float32 workspace ``[T, Hq, S, D]`` stays under (fewer splits for more tokens; none
    when one fits: large prefills fill the GPU with token tiles anyway)."""
    min_split_tiles: int = 1
    """A split covers at least this many KV tiles; 1: the device-side sizing (about one item a program)
    decides."""
    programs_per_sm: int = 4
    """Programs per SM of the persistent kernel; the device-side split sizing aims at one item a program."""
    launch: tuple[int, int] = (4, 2)
    """``(num_warps, num_stages)`` of every tile height but ``rows_few``: 4 warps for a ``[64, D]`` float32
    accumulator."""
    launch_few: tuple[int, int] = (2, 3)
    """``(num_warps, num_stages)`` of ``rows_few``-row tiles: 2 warps beat 4 in an H200 search at the engine's
    shared-level shapes although they spill (``benchmarks/engine/tune_cascade_prefill.py``)."""
    seq_pad_min: int = 256
    """Least width of the per-sequence vectors every program holds (:func:`seq_pad`; a power of two): each
    width is its own compiled kernel; 256 kept the engine's mixed steps from compiling new ones mid-run."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("rows", "rows_few", "seq_pad_min"):
            value = getattr(self, name)
            require(value >= 1 and next_pow2(value) == value, self, name, "a power of two >= 1")
        require(self.seq_pad_min <= MAX_SEQS, self, "seq_pad_min", f"at most MAX_SEQS ({MAX_SEQS})")
        for name in ("max_splits", "workspace_bytes", "min_split_tiles", "programs_per_sm"):
            require(getattr(self, name) >= 1, self, name, "an int >= 1")
        for name in ("launch", "launch_few"):
            warps, stages = getattr(self, name)
            require(
                warps in (1, 2, 4, 8, 16, 32) and stages >= 1,
                self,
                name,
                "(num_warps a power of two in [1, 32], num_stages >= 1)",
            )


knobs.register(KNOBS, CascadeKnobs())


class PrefillLaunch(NamedTuple):
    """The knob-decided launch choices of one :func:`paged_prefill_lse` call (:func:`prefill_launch`)."""

    rows: int
    """Query rows a tile was sized for (``rows`` / ``rows_few`` of the knobs, or the call's)."""
    tokens: int
    """Query tokens a tile holds (``rows // group``, at least 1)."""
    num_warps: int
    num_stages: int
    max_splits: int
    """KV splits per sequence at most (1: no split, no merge)."""
    min_split_tiles: int
    programs_per_sm: int


def prefill_launch(
    t: int,
    batch: int,
    hq: int,
    d: int,
    group: int,
    *,
    rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int | None = None,
    min_split_tiles: int | None = None,
    kn: CascadeKnobs | None = None,
) -> PrefillLaunch:
    """Tile height, warps, stages, split bound and persistent programs of a call with ``t`` query tokens over
    ``batch`` sequences, ``hq`` query heads of ``d`` dims in GQA groups of ``group``: the call's overrides
    where given, else the knobs (``kn``, default those in force). Pure arithmetic: raises nothing.

    >>> prefill_launch(256, 256, 16, 128, 2)[:5]  # cascade's shared level: 16-row tiles, 2 warps, 16 splits
    (16, 8, 2, 3, 16)
    """
    kn = kn or knobs.get(KNOBS)
    height = rows or (kn.rows_few if t <= ROWS_FEW_MAX_TOKENS * batch else kn.rows)
    warps, stages = kn.launch_few if height == kn.rows_few else kn.launch
    return PrefillLaunch(
        height,
        max(1, height // group),
        warps if num_warps is None else int(num_warps),
        stages if num_stages is None else int(num_stages),
        max(1, min(kn.max_splits, kn.workspace_bytes // max(1, t * hq * d * 4))),
        kn.min_split_tiles if min_split_tiles is None else min_split_tiles,
        programs_per_sm or kn.programs_per_sm,
    )


def seq_pad(batch: int, kn: CascadeKnobs | None = None) -> int:
    """The per-sequence vectors' width (``B_PAD``) for ``batch`` sequences: the knobs' ``seq_pad_min``
    (``kn``, default those in force), or the next power of two above it (at most :data:`MAX_SEQS`)."""
    return max((kn or knobs.get(KNOBS)).seq_pad_min, next_pow2(batch))
