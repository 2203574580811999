"""``triton.paged_decode``: our Triton split-K paged decode attention for ``lz.paged_attention``.

FlashDecoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"; vLLM's
``triton_decode_attention`` is the same two-stage shape): stage 1 splits every sequence's KV over S programs
(its ``BLOCK_N``-token tiles interleaved: split s takes tiles s, s + S, ..., so a sequence far shorter than
the block table's width still spreads over every split) and runs one program per (sequence, KV head, split)
holding all the query heads of the KV head's GQA group as one tile, online softmax in float32, writing a
partial output and its log-sum-exp to a float32 workspace; stage 2 merges the S partials (with one split,
stage 1 writes the output and stage 2 is skipped; eager calls merge in stage 1: the split that finishes last
does it: :attr:`PagedDecodeKnobs.fused_merge`). Tile size, split count and launch config follow an H200 search
(``benchmarks/tune_paged_decode.py``): :class:`PagedDecodeKnobs`. The Triton code is in ``_paged_kernels.py``,
imported on the first call (only after ``import triton`` succeeded in the backend's probe).

Graph-safe: no host read of ``seq_lens``/``block_tables``; the grid ``(B, Hkv, S)`` and ``S`` come from shapes
only (``max_blocks * P`` is the upper bound of every seq_len), the workspace is a ``torch.empty`` per call
(the caching allocator serves it from the graph's pool under capture). Splits with no tile below a sequence's
length are empty (lse ``-inf``, weight 0). Decode only: prefill/append (``cu_seqlens_q``) is refused by
:func:`check`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from layerzero.core import knobs
from layerzero.core.capture import AS_CAPTURED, capturing_now
from layerzero.core.context import SelectionContext
from layerzero.core.errors import InvalidInputError, expected_got
from layerzero.core.knobs import check_types, require
from layerzero.core.kv_layout import KV_LAYOUTS, KVLayout, cache_dims, nhd_view
from layerzero.core.kv_quant import KV_QUANT_DTYPES
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Phase

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, missing, next_pow2
from ._launch import launch_pinned, pdl_kwargs
from ._paged_common import scale_args, sm_count, split_counters

KERNEL_ID = "triton.paged_decode"
LSE_KERNEL_ID = "triton.paged_decode_lse"
PRIORITY = 40
"""Above ``torch_sdpa.paged_attention`` (10): one fused pass over the used pages, no padded gather."""
MAX_GROUP = 16
"""Query heads per KV head held in one tile (GQA ratio 1..16)."""
HEAD_DIM_MAX = 256
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
_KERNELS = LazyModule("_paged_kernels")


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


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    kv_layout: str | KVLayout = "NHD",
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
) -> Any:
    """Split-K paged decode attention (one query token per sequence) with our Triton kernels.

    Args:
        q: ``[B, Hq, D]`` float16/bfloat16/float32, last stride 1 (as for kv_cache, block_tables, seq_lens).
        kv_cache: ``[N, 2, P, Hkv, D]`` (``kv_layout="NHD"``) or ``[N, 2, Hkv, P, D]`` (``"HND"``), q's dtype
            (or float8_e4m3fn / int8 codes: a quantized cache) and device, last stride 1; K at index 0 of dim
            1, V at 1. Any page size P >= 1.
        block_tables: ``[B, M]`` int32; only the first ``ceil(seq_lens[b] / P)`` ids of row b are read.
        seq_lens: ``[B]`` int32 in ``[1, M * P]`` (KV tokens, the new one included); never read on the host.
        scale: softmax scale, default ``1 / sqrt(D)``.
        kv_layout: ``"NHD"`` or ``"HND"``.
        num_splits: force the number of KV splits (default: :func:`choose_split_len` from the shapes and SM
            count).
        block_n: KV positions per stage-1 step (power of two >= 16; default :func:`block_n_for`).
        num_warps, num_stages: stage-1 launch config (default :func:`launch_config`). Knobs for
            ``benchmarks/tune_paged_decode.py``.
        k_scale, v_scale: a quantized cache's per-tensor scales (positive floats, or 0-d / 1-element float32
            tensors on the device, read there: graph-safe); None = 1.0. Keys and values are read as
            ``code * scale`` in float32 and both dots run in float32 (``core.kv_quant.dequantize_kv``).
        return_lse: also return each row's natural-log sum-exp ``[B, Hq]`` float32
            (``triton.paged_decode_lse``).

    Returns:
        ``[B, Hq, D]`` in q's dtype (``(out, lse)`` with ``return_lse``). Cache slots past ``seq_lens[b]`` and
        unused blocks never reach it (masked loads: NaN there cannot leak).

    Raises:
        InvalidInputError: ``Hq / Hkv`` above 16, a last stride other than 1 (q, kv_cache, block_tables or
            seq_lens), ``block_n`` not a power of two >= 16
            (shapes, dtypes and index values are validated by ``lz.paged_attention`` before dispatch).
    """
    kern = _KERNELS.get()  # the @triton.jit code; triton imported fine in the backend's probe
    key = (
        q.shape,
        q.stride(),
        q.dtype,
        q.device,
        kv_cache.shape,
        kv_cache.stride(),
        kv_cache.dtype,
        block_tables.shape,
        block_tables.stride(),
        seq_lens.stride(),
        kv_layout,
        return_lse,
        num_splits,
        block_n,
        num_warps,
        num_stages,
    )
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(
            kern,
            q,
            kv_cache,
            block_tables,
            seq_lens,
            kv_layout,
            return_lse,
            num_splits,
            block_n,
            num_warps,
            num_stages,
        )
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    batch, hq, d = plan.out_shape
    out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, hq), dtype=torch.float32, device=q.device) if return_lse else out
    if batch == 0:
        return (out, lse) if return_lse else out
    # eager calls only: the split that finishes last merges, no stage 2 (one host launch less); under capture
    # (and lz.capture_selection) the two kernels, which replay faster (the knob fused_merge says why)
    captured = AS_CAPTURED.get() or capturing_now()
    fused = plan.fused_captured if captured else plan.fused_eager
    if plan.splits == 1:  # stage 1 stores the output itself: no workspace, no stage 2
        ws_out = ws_lse = out
    else:  # partial outputs [B, Hq, S, D] and their lse [B, Hq, S], float32, contiguous
        ws_out = torch.empty((batch, hq, plan.splits, d), dtype=torch.float32, device=q.device)
        ws_lse = torch.empty((batch, hq, plan.splits), dtype=torch.float32, device=q.device)
    cnt = split_counters(q, batch * plan.num_kv_heads) if fused else out
    qk_scale = (1.0 / math.sqrt(d) if scale is None else float(scale)) * kern.LOG2E
    ks, vs, qflags = scale_args(plan.quant, k_scale, v_scale)
    # every int and constexpr below is the plan's: it pins the launch (FastLaunch.pinned skips Triton's
    # binder)
    pdl = pdl_kwargs(q, batch, captured)
    launch_pinned(
        kern.paged_decode_split,
        (plan.serial, fused, bool(pdl), *qflags.values()),
        plan.grid,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        ws_out,
        ws_lse,
        lse,
        out,
        cnt,
        qk_scale,
        ks,
        vs,
        *plan.split_ints,
        **(plan.fused_kw if fused else plan.split_kw),
        **qflags,
        **pdl,
    )
    if plan.splits > 1 and not fused:
        launch_pinned(
            kern.paged_decode_merge,
            (plan.serial, bool(pdl)),
            (batch, hq),
            ws_out,
            ws_lse,
            out,
            lse,
            *plan.merge_ints,
            **plan.merge_kw,
            **pdl,
        )
    return (out, lse) if return_lse else out


class _Plan(NamedTuple):
    """What one call signature of :func:`paged_decode` (shapes, strides, dtypes, device, layout, arguments)
    launches with under the knobs in force: everything but the tensors' addresses and the scales, worked out
    on its first call (``_PLANS``, dropped when the knobs change)."""

    serial: int  # unique per plan made (FastLaunch.pinned's pin: never reused, unlike id())
    out_shape: tuple[int, int, int]
    num_kv_heads: int
    splits: int
    fused_eager: bool  # eager calls merge in the split kernel (knobs fused_merge, fused_merge_max_bytes)
    fused_captured: bool  # calls under capture / lz.capture_selection() do (fused_merge_in_graphs)
    quant: bool
    grid: tuple[int, int, int]
    split_ints: tuple[int, ...]  # stride_qb .. stride_lb of the stage-1 kernel (workspace strides included)
    merge_ints: tuple[int, ...]  # stride_ob .. num_splits of stage 2
    split_kw: dict[str, Any]  # its constexprs and launch config (two kernels, or one split)
    fused_kw: dict[str, Any]  # the same with the merge fused (eager calls)
    merge_kw: dict[str, Any]  # stage 2's constexprs and launch config


_PLANS: dict[tuple[Any, ...], _Plan] = {}
_SERIALS = itertools.count()
_PLANS_MAX = 4096
"""Plans kept (a server sees a few hundred call signatures; past this many the dict starts over)."""


def _drop_plans() -> None:
    _PLANS.clear()  # the module's dict at call time (tests replace it)


knobs.subscribe(KNOBS, _drop_plans)


def _plan(
    kern: Any,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_layout: str | KVLayout,
    return_lse: bool,
    num_splits: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> _Plan:
    """The :class:`_Plan` of a call under the knobs in force (checks included: the raises of
    :func:`paged_decode`)."""
    kn = knobs.get(KNOBS)
    batch, hq, d = q.shape
    _, page, hkv, _ = cache_dims(kv_cache, kv_layout)
    group = hq // hkv
    if group > MAX_GROUP:
        raise _bad(
            "GQA group Hq / Hkv",
            f"<= {MAX_GROUP}",
            f"{hq} / {hkv} = {group}",
            "Let LayerZero pick another paged kernel (torch_sdpa.paged_attention).",
        )
    strides = (q.stride(-1), kv_cache.stride(-1), block_tables.stride(-1), seq_lens.stride(-1))
    if strides != (1, 1, 1, 1):  # the kernels index each last dim with a unit stride
        raise _bad(
            "last strides of q, kv_cache, block_tables, seq_lens",
            "1 each (contiguous last dims)",
            strides,
            "Call .contiguous() first (lz.paged_attention filters this kernel out instead: "
            "STRIDE_LAST_DIM_NOT_1).",
        )
    quant = kv_cache.dtype in KV_QUANT_DTYPES
    width, itemsize = block_tables.shape[1] * page, 4 if quant else q.element_size()
    bn, split_len, splits, chunks, one_pass = geometry(
        batch, hkv, width, d, itemsize, sm_count(q.device), num_splits=num_splits, block_n=block_n, kn=kn
    )
    interpret = (
        type(kern.paged_decode_split).__name__ == "InterpretedFunction"
    )  # TRITON_INTERPRET=1 (CPU tests)
    st = nhd_view(kv_cache, kv_layout).stride()  # [N, 2, P, Hkv, D] order whatever the layout
    d_pad = max(16, next_pow2(d))
    config = launch_config(d, kn)
    if num_warps is not None:
        config["num_warps"] = int(num_warps)
    if num_stages is not None:
        config["num_stages"] = int(num_stages)
    split_kw = dict(
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=d,
        D_PAD=d_pad,
        BLOCK_N=bn,
        INTERPRET=interpret,
        TILES_PER_SPLIT=split_len // bn if interpret else 0,
        UPCAST=quant or (interpret and q.dtype == torch.bfloat16),
        DIRECT=splits == 1,
        WRITE_LSE=return_lse,
        FUSED_MERGE=False,
        S_PAD=1,
        CHUNKS=chunks,
        ONE_PASS=one_pass,
        EARLY=one_pass and kn.early_kv,
        TRIGGER_FIRST=one_pass and "split" in kn.trigger_first,
        **config,
    )
    kv_bytes = batch * hkv * splits * split_len * d * 2 * kv_cache.element_size()  # the most a call can read
    fused = splits > 1 and (
        kv_bytes <= kn.fused_merge_max_bytes if kn.fused_merge == "auto" else kn.fused_merge
    )
    # the workspace's strides (contiguous [B, Hq, S, D]); one split: the output's own ([B, Hq, D], contiguous)
    ws_strides = (hq * d, d, 0) if splits == 1 else (hq * splits * d, splits * d, d)
    return _Plan(
        next(_SERIALS),
        (batch, hq, d),
        hkv,
        splits,
        fused,
        fused and kn.fused_merge_in_graphs,
        quant,
        (batch, hkv, splits),
        (
            q.stride(0),
            q.stride(1),
            st[0],
            st[1],
            st[2],
            st[3],
            block_tables.stride(0),
            split_len,
            page,
            group,
            splits,
            width,
            *ws_strides,
            hq * splits,
        ),
        (hq * d, d, *ws_strides, hq, splits),
        split_kw,
        {**split_kw, "FUSED_MERGE": True, "S_PAD": next_pow2(splits)},
        dict(
            HEAD_DIM=d,
            D_PAD=d_pad,
            S_PAD=next_pow2(splits),
            WRITE_LSE=return_lse,
            num_warps=kn.merge_warps,
            TRIGGER_FIRST=one_pass and "merge" in kn.trigger_first,
        ),
    )


def paged_attention(
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None, v_scale=None
):
    """``lz.paged_attention`` canonical-args entry (see :func:`layerzero.ops.paged.prepare`), decode only: q
    ``[B, Hq, D]`` -> ``[B, Hq, D]`` in q's dtype; ``is_causal`` changes nothing for one query token (it sees
    every key). Raises ``InvalidInputError`` for ``cu_seqlens_q`` (prefill/append; :func:`check` keeps
    selection from ever routing it here) and what :func:`paged_decode` raises."""
    _decode_only(KERNEL_ID, cu_seqlens_q)
    return paged_decode(
        q, kv_cache, block_tables, seq_lens, scale, kv_layout, k_scale=k_scale, v_scale=v_scale
    )


def paged_attention_lse(
    q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None, v_scale=None
):
    """``lz.paged_attention(..., return_lse=True)`` canonical-args entry, decode only (as
    :func:`paged_attention`): ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32)``."""
    _decode_only(LSE_KERNEL_ID, cu_seqlens_q)
    return paged_decode(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        scale,
        kv_layout,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=True,
    )


def _decode_only(kernel_id: str, cu_seqlens_q: Any) -> None:
    """Raise ``InvalidInputError`` when ``kernel_id`` (a decode-only kernel) is called with
    ``cu_seqlens_q``."""
    if cu_seqlens_q is not None:
        raise InvalidInputError(
            expected_got(
                f"{kernel_id}: cu_seqlens_q",
                "None (decode: one query token per sequence)",
                "a tensor (prefill/append)",
                f"Prefill/append runs on another paged kernel; do not lock {kernel_id} for it.",
            )
        )


def check(ctx: SelectionContext) -> list[Reason]:
    """What the data constraints cannot say: decode only (``ctx.phase`` DECODE), GQA ratio <= 16, a paged
    layout."""
    out = []
    if ctx.phase is not Phase.DECODE:
        out.append(
            Reason(
                ReasonCode.SEQ_LEN_TOO_LONG,
                f"decode only (one query token per sequence); got phase {getattr(ctx.phase, 'value', None)} "
                f"(cu_seqlens_q given, q_len up to {ctx.seq_len_q}): prefill/append run on other kernels",
            )
        )
    ratio = ctx.gqa_ratio
    if ratio is not None and ratio > MAX_GROUP:
        out.append(
            Reason(ReasonCode.GQA_RATIO_INVALID, f"Hq / Hkv = {ratio} > {MAX_GROUP} (one GQA group per tile)")
        )
    if ctx.kv_layout not in KV_LAYOUTS:
        out.append(Reason(ReasonCode.KV_LAYOUT_UNSUPPORTED, f"kv_layout {ctx.kv_layout!r} is not NHD or HND"))
    if ctx.page_size is not None and ctx.page_size < 1:
        out.append(Reason(ReasonCode.SHAPE_MISMATCH, f"page size {ctx.page_size} < 1"))
    return out


def kernel_specs(available: bool, why: str) -> list[KernelSpec]:
    """The Triton paged KernelSpecs: ``triton.paged_decode`` (op ``paged_attention``, CUDA SM >= 8.0,
    fp16/bf16/ fp32, head dims 1..256, NHD and HND, any page size, GQA 1..16, decode only, graph-safe,
    deterministic, priority 40), ``triton.paged_decode_lse`` (the same for op ``paged_attention_lse``), then
    the cascade kernels (``triton.paged_prefill_lse``, ``triton.merge_attention_states``: :mod:`.cascade`).
    When ``available`` is False the specs are still registered and their callables raise
    ``BackendNotAvailableError`` with ``why``."""
    from . import cascade

    common: dict[str, Any] = dict(
        priority=PRIORITY,
        device_types=CUDA,
        dtypes=FLOATS,
        sm_min=SM_MIN,
        head_dim_min=1,
        head_dim_max=HEAD_DIM_MAX,
        supports_backward=False,
        supports_dropout=False,
        requires_stride_last_1=True,
        deterministic=True,
        graph_safe=True,
        check=check,
        workspace=workspace_bytes,
        kv_cache_dtypes=KV_QUANT_DTYPES,
    )
    return [
        KernelSpec(
            KERNEL_ID,
            "paged_attention",
            paged_attention if available else missing(KERNEL_ID, why),
            description="Triton split-K paged decode (FlashDecoding): per (sequence, KV head, split) online "
            "softmax over the used pages, GQA group as one tile, then a log-sum-exp merge",
            **common,
        ),
        KernelSpec(
            LSE_KERNEL_ID,
            "paged_attention_lse",
            paged_attention_lse if available else missing(LSE_KERNEL_ID, why),
            description="triton.paged_decode returning each row's log-sum-exp too (the split merge's lse)",
            **common,
        ),
        *cascade.kernel_specs(available, why),
    ]
