"""The knobs of ``triton.paged_decode`` and the launch geometry they decide: :class:`PagedDecodeKnobs`
(registered here, as ``"triton.paged_decode"``, when :mod:`.paged` imports this module), the tile / split /
one-pass rules (:func:`tile_rule`, :func:`choose_split_len`, :func:`chunk_rule`, :func:`geometry`), the
stage-1 launch config and the workspace bound of a selection bucket (:func:`workspace_bytes`). Pure arithmetic
on shapes and knobs: no tensor is read, nothing here imports triton. Split from :mod:`.paged` (which
re-exports every name) so that the rules read apart from the launch (:mod:`._paged_launch`) and the
KernelSpecs; ``triton.rope_paged_decode`` sizes its splits with the same rules (through :mod:`.paged`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from layerzero.core import knobs
from layerzero.core.context import SelectionContext
from layerzero.core.errors import InvalidInputError, expected_got
from layerzero.core.knobs import check_types, require

from ._common import next_pow2

KERNEL_ID = "triton.paged_decode"
"""The kernel's id (the prefix of :func:`_bad`'s messages)."""
MAX_GROUP = 16
"""Query heads per KV head held in one tile (GQA ratio 1..16)."""

KNOBS = "triton.paged_decode"
"""The name :class:`PagedDecodeKnobs` is registered under (``layerzero.core.knobs``)."""


@dataclass(frozen=True, slots=True)
class PagedDecodeKnobs:
    """Tuning choices of ``triton.paged_decode`` (and ``triton.rope_paged_decode``'s split geometry),
    registered as ``"triton.paged_decode"``: defaults from H200 searches
    (``benchmarks/results/knobs/triton_paged_decode.md``), read once per call signature's plan (a change drops
    the cached plans). Raises ``ConfigurationError`` for a field of the wrong type or out of range."""

    max_splits: int = 32
    """Most KV splits per sequence (stage 2 merges them in one tile)."""
    min_tiles_per_split: int = 2
    """A split covers at least this many ``BLOCK_N`` tiles: short splits cost more in the merge than they
    save."""
    waves: int = 4
    """Stage 1 aims at ``waves x SM count`` programs, so small batches with long contexts fill the GPU (B8,
    32k tokens, D 256: 942 -> 482 µs against 2 waves)."""
    tile_bytes: int = 32768
    """Bytes of one ``[BLOCK_N, D]`` K tile (:func:`block_n_for`): the largest that keeps K and V of two to
    three pipeline stages in shared memory measured fastest."""
    block_n_max: int = 128
    """Most KV positions of a general tile (:func:`block_n_for`)."""
    small_batch: tuple[int, int, int, int] | None = (1, 2048, 32, 32)
    """``(most sequences, widest block table in tokens, block_n, most
    splits)``: launches within both bounds take ``block_n``-position tiles and at most that many splits
    (:func:`tile_rule`), so a short sequence spreads over more programs (the engine's batch-1 decode step
    faster at KV up to 2048); None: the general rule everywhere."""
    one_pass: bool = True
    """Under ``small_batch``'s rule, a split of at most ``one_pass_max_tiles`` tiles gathers them all at once,
    then attends (:func:`chunk_rule`), instead of the tile loop's block ids -> K / V -> attend chain per
    tile."""
    one_pass_max_tiles: int = 2
    """Most tiles a one-pass split gathers: 1, 2 or 4 (the kernel's limit); four measured slower than the
    loop."""
    early_kv: bool = False
    """With ``one_pass``: the split program reads ``seq_len``, its block ids and every K / V position but the
    newest before its PDL wait. Off: no gain once ``trigger_first`` is on, and it adds a contract
    (``_gdc_kernels``)."""
    trigger_first: tuple[str, ...] = ("merge",)
    """Kernels (``"split"``, ``"merge"``) of a PDL-launched one-pass call that let the next kernel launch
    before their own wait, so the next projections' weights stream during attention; ``()``: off."""
    split_warps: int = 4
    """Warps per stage-1 program (:func:`launch_config`; ``num_warps=`` overrides it per call)."""
    merge_warps: int = 4
    """Warps per stage-2 (merge) program."""
    fused_merge: bool | Literal["auto"] = "auto"
    """Eager calls with several splits merge in the split kernel (the split that finishes last merges: one
    launch fewer). ``"auto"``: when the call reads at most ``fused_merge_max_bytes`` (host-bound calls; above
    it the GPU time of two kernels is lower); True / False: every eager call / none. Both forms agree to
    rounding."""
    fused_merge_max_bytes: int = 32 << 20
    """``"auto"`` fuses when the most K / V bytes a call can read (from shapes) is at most this: 32 MiB, ~8 µs
    of the H200's HBM, about one eager launch's host time."""
    fused_merge_in_graphs: bool = False
    """Fuse under CUDA-graph capture (and ``lz.capture_selection()``) too; off: replayed, the fused form was
    3-24% slower than the merge kernel."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("max_splits", "min_tiles_per_split", "waves", "tile_bytes"):
            require(getattr(self, name) >= 1, self, name, "an int >= 1")
        bn = self.block_n_max
        require(bn >= 16 and next_pow2(bn) == bn, self, "block_n_max", "a power of two >= 16")
        sb = self.small_batch
        require(
            sb is None or min(sb) >= 1 and next_pow2(sb[2]) == sb[2] and sb[2] >= 16,
            self,
            "small_batch",
            "None or (sequences >= 1, tokens >= 1, block_n a power of two >= 16, splits >= 1)",
        )
        require(self.one_pass_max_tiles in (1, 2, 4), self, "one_pass_max_tiles", "1, 2 or 4")
        require(
            set(self.trigger_first) <= {"split", "merge"},
            self,
            "trigger_first",
            "a tuple of 'split' and / or 'merge'",
        )
        for name in ("split_warps", "merge_warps"):
            require(getattr(self, name) in (1, 2, 4, 8, 16, 32), self, name, "a power of two in [1, 32]")
        require(self.fused_merge_max_bytes >= 0, self, "fused_merge_max_bytes", "an int >= 0")


knobs.register(KNOBS, PagedDecodeKnobs())


def block_n_for(head_dim: int, itemsize: int = 2, kn: PagedDecodeKnobs | None = None) -> int:
    """KV positions per stage-1 step: the most positions (a power of two in ``[16, block_n_max]``) whose K
    tile ``[BLOCK_N, next_pow2(D)]`` fits ``tile_bytes`` at ``itemsize`` bytes per element (``kn``: the knobs,
    default those in force).

    >>> block_n_for(128), block_n_for(256), block_n_for(128, 4), block_n_for(64)
    (128, 64, 64, 128)
    """
    kn = kn or knobs.get(KNOBS)
    return max(16, min(kn.block_n_max, kn.tile_bytes // (max(16, next_pow2(head_dim)) * itemsize)))


def tile_rule(
    batch: int, width: int, head_dim: int, itemsize: int, kn: PagedDecodeKnobs | None = None
) -> tuple[int, int]:
    """``(block_n, most splits)`` of a launch over ``batch`` sequences with a block table ``width`` tokens
    wide: ``small_batch``'s within its bounds where the general rule splits too (a table of at least
    ``2 * min_tiles_per_split`` general tiles: narrower ones run one program a head and no merge, as before,
    so an eager call and a graph replay of a short-window model compute the same bits), else
    :func:`block_n_for` and ``max_splits``. ``head_dim`` in elements, ``itemsize`` the bytes of one cached
    element as the kernel reads it (4 for a quantized cache: its tiles are float32); block_n in KV positions.
    Pure arithmetic: raises nothing.

    >>> [tile_rule(b, n, 128, 2) for b, n in ((1, 2048), (2, 2048), (1, 4096), (1, 384))]
    [(32, 32), (128, 32), (128, 32), (128, 32)]
    """
    kn = kn or knobs.get(KNOBS)
    if small_batch(batch, width, head_dim, itemsize, kn):
        return kn.small_batch[2], kn.small_batch[3]  # type: ignore[index]  # small_batch: not None
    return block_n_for(head_dim, itemsize, kn), kn.max_splits


def small_batch(
    batch: int, width: int, head_dim: int, itemsize: int, kn: PagedDecodeKnobs | None = None
) -> bool:
    """Whether a launch takes ``small_batch``'s tiles (see :func:`tile_rule`; same arguments)."""
    kn = kn or knobs.get(KNOBS)
    sb = kn.small_batch
    return (
        sb is not None
        and batch <= sb[0]
        and width <= sb[1]
        and math.ceil(width / block_n_for(head_dim, itemsize, kn)) >= 2 * kn.min_tiles_per_split
    )


def chunk_rule(tiles_per_split: int, small: bool, kn: PagedDecodeKnobs | None = None) -> tuple[int, bool]:
    """``(tiles a split gathers at once, one pass)`` of a launch whose splits have at most ``tiles_per_split``
    tiles: under ``small_batch``'s rule (``small``) with ``one_pass`` on and at most ``one_pass_max_tiles``
    tiles a split, every tile at once (1, 2 or 4: the next power of two) in one pass; else ``(1, False)``: the
    tile loop.

    >>> chunk_rule(2, True), chunk_rule(2, False), chunk_rule(5, True)
    ((2, True), (1, False), (1, False))
    """
    kn = kn or knobs.get(KNOBS)
    if not (small and kn.one_pass and tiles_per_split <= min(4, kn.one_pass_max_tiles)):
        return 1, False
    return next_pow2(max(1, tiles_per_split)), True


def launch_config(head_dim: int, kn: PagedDecodeKnobs | None = None) -> dict[str, int]:
    """Stage-1 ``num_warps`` / ``num_stages`` (measured on the H200): ``split_warps`` warps; 2 pipeline stages
    for head dims above 128 (three 64 KB K+V stages would not fit shared memory), Triton's default below."""
    warps = (kn or knobs.get(KNOBS)).split_warps
    return {"num_warps": warps, "num_stages": 2} if next_pow2(head_dim) > 128 else {"num_warps": warps}


def choose_split_len(
    batch: int,
    num_kv_heads: int,
    max_kv_len: int,
    sms: int,
    block_n: int,
    num_splits: int | None = None,
    max_splits: int | None = None,
    kn: PagedDecodeKnobs | None = None,
) -> tuple[int, int]:
    """Split-K sizing from shapes only: ``(split_len, num_splits)``, both ints, ``split_len`` in tokens (a
    multiple of ``block_n``) and ``num_splits * split_len >= max_kv_len``. The kernel interleaves a sequence's
    ``block_n``-token tiles over the splits (split s takes tiles s, s + S, ...), so ``split_len`` is the most
    tokens one split reads (the interpreter's trip count), whatever the sequence's own length.

    Without ``num_splits``: aim at ``waves * sms`` stage-1 programs over ``batch * num_kv_heads`` (sequence,
    head) pairs, at most ``max_splits`` splits (default: the knobs') and at least ``min_tiles_per_split``
    tiles per split (at batch 1 more splits of one tile each measured faster alone but slower in the engine's
    decode graph: see ``benchmarks/engine/paged_b1_search.py``). ``num_splits`` forces a count (tests; clipped
    to ``[1, max_splits]`` and to one tile per split).

    >>> choose_split_len(1, 8, 32768, 132, 64)   # one long sequence on an H100/H200: 32 splits of 1024 tokens
    (1024, 32)
    >>> choose_split_len(128, 8, 4096, 132, 128)  # big batch: 1024 (sequence, head) pairs fill the GPU alone
    (4096, 1)
    >>> choose_split_len(1, 8, 2080, 132, 128)  # batch 1, a 2080-token table: 8 splits asked, 6 of 384 tokens
    (384, 6)
    """
    kn = kn or knobs.get(KNOBS)
    tiles = max(1, math.ceil(max_kv_len / block_n))
    if num_splits is None:
        want = math.ceil(kn.waves * sms / max(1, batch * num_kv_heads))
        num_splits = min(want, max(1, tiles // kn.min_tiles_per_split))
    splits = max(1, min(int(num_splits), kn.max_splits if max_splits is None else max_splits, tiles))
    split_len = math.ceil(tiles / splits) * block_n
    return split_len, math.ceil(tiles * block_n / split_len)


class Geometry(NamedTuple):
    """A launch's split geometry (:func:`geometry`): KV positions per tile, the most tokens a split reads, the
    split count, tiles a split gathers at once, and whether splits gather them in one pass."""

    block_n: int
    split_len: int
    splits: int
    chunks: int
    one_pass: bool


def geometry(
    batch: int,
    num_kv_heads: int,
    width: int,
    head_dim: int,
    itemsize: int,
    sms: int,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    kn: PagedDecodeKnobs | None = None,
) -> Geometry:
    """The split geometry of a launch from shapes and knobs only (pure arithmetic, no tensor: what
    :func:`_plan` launches with): ``width`` the block table's width in tokens, ``itemsize`` as
    :func:`tile_rule`'s, ``sms`` the device's SM count, ``num_splits`` / ``block_n`` forced values (None:
    :func:`choose_split_len`'s and :func:`tile_rule`'s), ``kn`` the knobs (default: those in force).

    >>> geometry(1, 8, 32768, 128, 2, 132)
    Geometry(block_n=128, split_len=1024, splits=32, chunks=1, one_pass=False)

    Raises:
        InvalidInputError: ``block_n`` not a power of two >= 16.
    """
    kn = kn or knobs.get(KNOBS)
    bn, most = tile_rule(batch, width, head_dim, itemsize, kn)
    bn = bn if block_n is None else int(block_n)
    if bn < 16 or bn & (bn - 1):
        raise _bad("block_n", "a power of two >= 16", bn)
    split_len, splits = choose_split_len(batch, num_kv_heads, width, sms, bn, num_splits, most, kn)
    small = block_n is None and small_batch(batch, width, head_dim, itemsize, kn)
    chunks, one_pass = chunk_rule(-(-split_len // bn), small, kn)
    return Geometry(bn, split_len, splits, chunks, one_pass)


def workspace_bytes(ctx: SelectionContext) -> int:
    """Upper bound of the float32 workspace (partial outputs ``[B, Hq, S, D]`` + lse ``[B, Hq, S]``) in bytes
    for every call of ``ctx``'s bucket (``ctx.batch`` and ``ctx.seq_len_kv`` are bucket upper bounds), under
    the knobs in force."""
    kn = knobs.get(KNOBS)
    b, hq, hkv, d = ctx.batch or 1, ctx.num_heads_q or 1, ctx.num_heads_kv or 1, ctx.head_dim or 1
    itemsize = ctx.dtype.itemsize if isinstance(ctx.dtype, torch.dtype) else 2
    kv = ctx.seq_len_kv or 1
    # (block_n, most splits, widest table) of every rule a call of the bucket may take (tile_rule): the
    # general one (fp32 tiles for a quantized cache too), and small_batch's for tables up to its width
    rules = [(block_n_for(d, size, kn), kn.max_splits, kv) for size in (itemsize, 4)]
    if kn.small_batch is not None:
        rules.append((kn.small_batch[2], kn.small_batch[3], min(kv, kn.small_batch[1])))
    cap = 1
    for bn, most, width in rules:
        tiles = max(1, math.ceil(width / bn))
        cap = max(cap, min(most, tiles, max(1, tiles // kn.min_tiles_per_split)))
    sms = ctx.device.multiprocessor_count or 1
    # b' * ceil(X / b') <= X + b' - 1 for every batch b' <= b of the bucket
    rows = min(b * cap, b + math.ceil(kn.waves * sms / hkv))
    return rows * hq * (d + 1) * 4


def _bad(what: str, expected: Any, got: Any, fix: str = "") -> InvalidInputError:
    return InvalidInputError(expected_got(f"{KERNEL_ID}: {what}", expected, got, fix))
