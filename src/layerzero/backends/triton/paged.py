"""``triton.paged_decode``: our Triton split-K paged decode attention for ``lz.paged_attention``.

FlashDecoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"; vLLM's
``triton_decode_attention`` is the same two-stage shape): stage 1 splits every sequence's KV over S programs (its
``BLOCK_N``-token tiles interleaved: split s takes tiles s, s + S, ..., so a sequence far shorter than the block
table's width still spreads over every split) and runs one program per (sequence, KV head, split) holding all the query heads of the KV head's GQA group as one
tile, online softmax in float32, writing a partial output and its log-sum-exp to a float32 workspace; stage 2
merges the S partials (with one split, stage 1 writes the output and stage 2 is skipped; eager calls merge in stage 1:
the split that finishes last does it, :data:`FUSED_MERGE`). Tile size, split
count and launch config follow an H200 search (``benchmarks/tune_paged_decode.py``). The Triton code is in
``_paged_kernels.py``, imported on the first call (only after ``import triton`` succeeded in the backend's probe).

Graph-safe: no host read of ``seq_lens``/``block_tables``; the grid ``(B, Hkv, S)`` and ``S`` come from shapes
only (``max_blocks * P`` is the upper bound of every seq_len), the workspace is a ``torch.empty`` per call (the
caching allocator serves it from the graph's pool under capture). Splits with no tile below a sequence's length are
empty (lse ``-inf``, weight 0). Decode only: prefill/append (``cu_seqlens_q``) is refused by :func:`check`.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, NamedTuple

import torch

from layerzero.core.capture import AS_CAPTURED, capturing_now
from layerzero.core.context import SelectionContext
from layerzero.core.errors import InvalidInputError, expected_got
from layerzero.core.kv_layout import KV_LAYOUTS, KVLayout, cache_dims, nhd_view
from layerzero.core.kv_quant import KV_QUANT_DTYPES
from layerzero.core.reasons import Reason, ReasonCode
from layerzero.core.specs import KernelSpec, Phase

from ._common import CUDA, FLOATS, SM_MIN, LazyModule, kernel_scale, missing, next_pow2
from ._launch import launch_pinned, pdl_kwargs

KERNEL_ID = "triton.paged_decode"
LSE_KERNEL_ID = "triton.paged_decode_lse"
PRIORITY = 40
"""Above ``torch_sdpa.paged_attention`` (10): one fused pass over the used pages, no padded gather."""
MAX_GROUP = 16
"""Query heads per KV head held in one tile (GQA ratio 1..16)."""
HEAD_DIM_MAX = 256
MAX_SPLITS = 32
"""Most KV splits per sequence (stage 2 merges them in one tile)."""
MIN_TILES_PER_SPLIT = 2
"""A split covers at least this many ``BLOCK_N`` tiles (short splits cost more in the merge than they save)."""
WAVES = 4
"""Stage 1 aims at ``WAVES * SM count`` programs so small batches with long contexts fill the GPU (H200 search,
``benchmarks/results/paged_decode_tuning/``: B8 S32768 D256 ran 942 µs with the 2 waves used before, 482 µs with
more splits; elsewhere the split count moved times by a few percent at most)."""
TILE_BYTES = 32768
"""Bytes of one ``[BLOCK_N, D]`` K tile: the H200 search found the largest tile that keeps K and V of two to three
pipeline stages in shared memory the fastest (bf16/fp16: 128 positions for D <= 128, 64 for D = 256)."""
SMALL_BATCH: tuple[int, int, int, int] | None = (1, 2048, 32, 32)
"""``(most sequences, widest block table in tokens, block_n, most splits)``: a launch of at most that many sequences
whose block table spans at most that many tokens (``M * P``: a decode graph's width, the longest sequence it can
serve) takes KV tiles of ``block_n`` positions and at most that many splits instead of :data:`TILE_BYTES`' tiles and
:data:`MAX_SPLITS`: a short sequence spreads over more programs, each gathering less, and with :data:`ONE_PASS` each
program gathers its (at most :data:`MIN_TILES_PER_SPLIT`) tiles at once. None: the general rule everywhere.

H200, Qwen3-0.6B's attention (16 / 8 heads of 128, bf16, page 16), 28-layer graphs of the kernel alone
(``benchmarks/engine/paged_small_batch.py``, ``benchmarks/results/engine/h200/2026-11-28f/``), µs a layer at KV 256 /
512 / 768 / 1024 / 2048 in a 2048-token table: 32-position tiles, 32 splits, one pass 5.24 / 6.39 / 6.81 / 7.10 /
9.02; the rule before (16 splits, a tile loop: 2026-11-28d) 5.34 / 6.01 / 7.57 / 7.84 / 11.18; the general rule
(2026-11-28d) 6.03-6.88 at 512, 11.4 at 4096. In the engine's batch-1 decode graph (``benchmarks/engine/batch1_ab.py``)
a step costs the same on average over KV 256-768 (676 µs) and 9-10 µs less at KV 768 (replay 685-686 against
694-696); with a 1024-token prompt (KV 1024-1536) 749 against 755 µs, decode 1,344 against 1,321 tok/s. The 2026-11-28d rule had replayed the graph in 652-655 µs against 676-680 for the general one (KV 256-512).
Longer sequences lose with small tiles (a 3072-token prompt in an 8192-token table: 943 vs 819 µs a step), hence the
width bound. Tables of fewer than ``2 * MIN_TILES_PER_SPLIT`` general tiles keep the general rule (:func:`tile_rule`)."""
ONE_PASS = True
"""Under :data:`SMALL_BATCH`'s rule, when a split has at most :data:`ONE_PASS_MAX_TILES` tiles (:func:`chunk_rule`):
the split program gathers all of them at once (block ids read below the table's width, not waiting for ``seq_len``;
K / V below ``seq_len``), then attends the ones below ``seq_len``, instead of the tile loop's block-id -> K / V ->
attend chain per tile (Triton pipelines the loop, but a tile's K / V still wait for its block ids). Measured with
:data:`SMALL_BATCH` (its docstring)."""
ONE_PASS_MAX_TILES = 2
"""Most tiles a split gathers in one pass (1, 2 or 4; the kernel takes up to 4). 2: what the H200 measured faster
(32 splits of two tiles at a 2048-token table). 16 splits of four tiles in one pass were slower than the loop at
KV <= 1024 (5.82 vs 5.34 µs a layer at 256: four tiles of registers; the engine's graph 683 against 677-679 µs), so a
GPU whose split count leaves three or four tiles a split (fewer SMs) keeps the loop until measured."""
EARLY_KV = False
"""With :data:`ONE_PASS`: a split program reads ``seq_len``, its block ids and every K / V position but the newest
before its PDL wait (``paged_decode_split``'s ``EARLY``), so the K / V loads overlap the kernel just before (in a
decode step the KV write, which writes each sequence's newest position only: a contract of PDL-launched decode
steps, ``_gdc_kernels``); the queries and the newest position after it. False (default): every load after the wait.
H200, the engine's batch-1 decode graph (``benchmarks/engine/batch1_ab.py``, 2026-11-28 seventh session): alone it took
the graph 685-692 -> 669-672 µs (replay at KV 768 685-689 -> 669); with :data:`TRIGGER_FIRST` and
``gemv.TRIGGER_FIRST_ROWS`` (which stream the next projections' weights during the same attention block) it measured
the same as without (graph 658-659 against 659-660 µs over three rounds), so it is off: no extra contract for nothing.
Kept as a knob (tested on CPU and GPU) for longer contexts and other GPUs."""
TRIGGER_FIRST: tuple[str, ...] = ("merge",)
"""Kernels of a PDL-launched one-pass call (:data:`ONE_PASS`: batch 1) that let the next kernel launch before their own
wait instead of after it (``gdc_enter``'s ``FIRST``; ``"split"``, ``"merge"``): the output projection then launches
during the split kernel and, being a one-row prefetch GEMV that does the same (``gemv.TRIGGER_FIRST_ROWS``), the MLP's
gate/up projection too, so their weight slabs stream while attention runs. Safe for any kernel after: what a kernel
reads before its wait is never written by a kernel of the step (``_gdc_kernels``). H200, the engine's batch-1 graph: see
``gemv.TRIGGER_FIRST_ROWS``; the split kernel too (``("split", "merge")``) measured the same as the merge alone. ``()``:
off."""
BLOCK_N_MAX = 128
SPLIT_WARPS = 4
"""Warps per stage-1 program (:func:`launch_config`; ``num_warps=`` overrides it per call). Read when a call
signature's plan is made: after changing it (A/B benchmarks) clear ``_PLANS`` (``benchmarks/engine/batch1_ab.py``
does)."""
MERGE_WARPS = 4
"""Warps per stage-2 (merge) program (read as :data:`SPLIT_WARPS` is)."""


FUSED_MERGE: bool | str = "auto"
"""Eager calls with several splits may merge them in the split kernel: the split that finishes last for a (sequence,
KV head) merges (one launch; CUTLASS's serial split-K semaphore) instead of a second kernel, which saves one Triton
launch of host time but costs GPU time (the last program's serial merge after a barrier and an atomic). ``"auto"``
(default): fused when the call's K/V read is small (:data:`FUSED_MERGE_MAX_BYTES`), where an eager call is
host-bound and one launch fewer is the win; two kernels above it, where the GPU time dominates (H200, the hidden
check's B24 bimodal shape, ``benchmarks/results/fused_merge_h200.md``: 80 / 61 µs fused vs 101 / 71 with two
launches while the host path was slow; once the plan and the pinned launch made it GPU-bound, 57.4 fused vs 53.8 µs
two kernels). ``True`` / ``False``: fused / two kernels for every eager call (the benchmark and tests set these).
Never under CUDA-graph capture (replayed, the fused form was 3-24% slower than the merge kernel), nor under
``lz.capture_selection()``. Both forms run the same merge code (``merge_row``) and agree to rounding, not always to
the last bit (the H200 showed 1-ulp differences on some rows)."""

FUSED_MERGE_MAX_BYTES = 32 << 20
"""``"auto"`` fuses the merge when the most K/V bytes a call can read (every split full: batch x KV heads x splits x
split length x head dim x 2 x element size, from shapes) is at most this: 32 MiB, ~8 µs of the H200's HBM, the
order of one eager launch's host time; the B24 shape above reads up to ~300 MB."""

FUSED_MERGE_IN_GRAPHS = False
"""Use the fused merge under capture too (what ``benchmarks/bench_fused_merge.py`` sets to compare both forms in a
graph); off by default for the reason :data:`FUSED_MERGE` gives."""

_KERNELS = LazyModule("_paged_kernels")
_COUNTERS: dict[tuple[str, int, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
_COUNTERS_MIN = 4096


def interpret_mode(kern: Any) -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return type(kern.paged_decode_split).__name__ == "InterpretedFunction"


def split_counters(q: torch.Tensor, n: int) -> torch.Tensor:
    """The fused merge's int32 counters (at least ``n``, all 0 between launches: the last split of each (sequence,
    KV head) puts its counter back) for the stream the call runs on. One zeroed buffer per (device, current stream),
    made on first use and kept: a call reuses it, so a CUDA graph captures its address; under capture the zeroing is
    captured too (a memset node, harmless: the counters are 0 there anyway). A buffer that is outgrown is replaced
    and kept alive (graphs captured with it still point at it). Launches on different streams never share counters;
    graphs captured on one stream share its buffer, so two such graphs must not be replayed at the same time on two
    streams (as with every other buffer two graphs share through a memory pool)."""
    dev = q.device
    stream = torch._C._cuda_getCurrentRawStream(dev.index) if dev.type == "cuda" else 0
    key = (dev.type, -1 if dev.index is None else dev.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, _COUNTERS_MIN), dtype=torch.int32, device=dev)
    return buf


def block_n_for(head_dim: int, itemsize: int = 2) -> int:
    """KV positions per stage-1 step: the most positions (a power of two in ``[16, 128]``) whose K tile
    ``[BLOCK_N, next_pow2(D)]`` fits :data:`TILE_BYTES` at ``itemsize`` bytes per element.

    >>> block_n_for(128), block_n_for(256), block_n_for(128, 4), block_n_for(64)
    (128, 64, 64, 128)
    """
    return max(16, min(BLOCK_N_MAX, TILE_BYTES // (max(16, next_pow2(head_dim)) * itemsize)))


def tile_rule(batch: int, width: int, head_dim: int, itemsize: int) -> tuple[int, int]:
    """``(block_n, most splits)`` of a launch over ``batch`` sequences with a block table ``width`` tokens wide:
    :data:`SMALL_BATCH`'s within its bounds where the general rule splits too (a table of at least
    ``2 * MIN_TILES_PER_SPLIT`` general tiles: narrower ones run one program a head and no merge, as before, so an
    eager call and a graph replay of a short-window model compute the same bits), else :func:`block_n_for` and
    :data:`MAX_SPLITS`. ``head_dim`` in elements, ``itemsize`` the bytes of one cached element as the kernel reads it
    (4 for a quantized cache: its tiles are float32); block_n in KV positions. Pure arithmetic: raises nothing.

    >>> tile_rule(1, 2048, 128, 2), tile_rule(2, 2048, 128, 2), tile_rule(1, 4096, 128, 2), tile_rule(1, 384, 128, 2)
    ((32, 32), (128, 32), (128, 32), (128, 32))
    """
    if small_batch(batch, width, head_dim, itemsize):
        return SMALL_BATCH[2], SMALL_BATCH[3]  # type: ignore[index]  # small_batch: not None
    return block_n_for(head_dim, itemsize), MAX_SPLITS


def small_batch(batch: int, width: int, head_dim: int, itemsize: int) -> bool:
    """Whether a launch takes :data:`SMALL_BATCH`'s tiles (see :func:`tile_rule`; same arguments)."""
    return (SMALL_BATCH is not None and batch <= SMALL_BATCH[0] and width <= SMALL_BATCH[1]
            and math.ceil(width / block_n_for(head_dim, itemsize)) >= 2 * MIN_TILES_PER_SPLIT)


def chunk_rule(tiles_per_split: int, small: bool) -> tuple[int, bool]:
    """``(tiles a split gathers at once, one pass)`` of a launch whose splits have at most ``tiles_per_split`` tiles:
    under :data:`SMALL_BATCH`'s rule (``small``) with :data:`ONE_PASS` on and at most :data:`ONE_PASS_MAX_TILES`
    tiles a split, every tile at once (1, 2 or 4: the next power of two) in one pass; else ``(1, False)``: the tile
    loop.

    >>> chunk_rule(2, True) == ((2, True) if ONE_PASS else (1, False)), chunk_rule(2, False), chunk_rule(5, True)
    (True, (1, False), (1, False))
    """
    if not (small and ONE_PASS and tiles_per_split <= min(4, ONE_PASS_MAX_TILES)):
        return 1, False
    return next_pow2(max(1, tiles_per_split)), True


def launch_config(head_dim: int) -> dict[str, int]:
    """Stage-1 ``num_warps`` / ``num_stages`` (measured on the H200): 4 warps; 2 pipeline stages for head dims
    above 128 (three 64 KB K+V stages would not fit shared memory), Triton's default below."""
    return {"num_warps": SPLIT_WARPS, "num_stages": 2} if next_pow2(head_dim) > 128 else {"num_warps": SPLIT_WARPS}


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (``multi_processor_count``, cached per device); 1 elsewhere
    (the Triton interpreter on CPU)."""
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_split_len(batch: int, num_kv_heads: int, max_kv_len: int, sms: int, block_n: int,
                     num_splits: int | None = None, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """Split-K sizing from shapes only: ``(split_len, num_splits)``, both ints, ``split_len`` in tokens (a multiple
    of ``block_n``) and ``num_splits * split_len >= max_kv_len``. The kernel interleaves a sequence's
    ``block_n``-token tiles over the splits (split s takes tiles s, s + S, ...), so ``split_len`` is the most
    tokens one split reads (the interpreter's trip count), whatever the sequence's own length.

    Without ``num_splits``: aim at ``WAVES * sms`` stage-1 programs over ``batch * num_kv_heads`` (sequence, head)
    pairs, at most ``max_splits`` splits and at least ``MIN_TILES_PER_SPLIT`` tiles per split (at batch 1 more
    splits of one tile each measured faster alone but slower in the engine's decode graph: see
    ``benchmarks/engine/paged_b1_search.py``). ``num_splits``
    forces a count (tests; clipped to ``[1, max_splits]`` and to one tile per split).

    >>> choose_split_len(1, 8, 32768, 132, 64)   # one long sequence on an H100/H200: 32 splits of 1024 tokens
    (1024, 32)
    >>> choose_split_len(128, 8, 4096, 132, 128)  # big batch: 1024 (sequence, head) pairs fill the GPU alone
    (4096, 1)
    >>> choose_split_len(1, 8, 2080, 132, 128)  # batch 1, a 2080-token table: 8 splits asked, 6 of 384 tokens
    (384, 6)
    """
    tiles = max(1, math.ceil(max_kv_len / block_n))
    if num_splits is None:
        want = math.ceil(WAVES * sms / max(1, batch * num_kv_heads))
        num_splits = min(want, max(1, tiles // MIN_TILES_PER_SPLIT))
    splits = max(1, min(int(num_splits), max_splits, tiles))
    split_len = math.ceil(tiles / splits) * block_n
    return split_len, math.ceil(tiles * block_n / split_len)


def workspace_bytes(ctx: SelectionContext) -> int:
    """Upper bound of the float32 workspace (partial outputs ``[B, Hq, S, D]`` + lse ``[B, Hq, S]``) in bytes for
    every call of ``ctx``'s bucket (``ctx.batch`` and ``ctx.seq_len_kv`` are bucket upper bounds)."""
    b, hq, hkv, d = ctx.batch or 1, ctx.num_heads_q or 1, ctx.num_heads_kv or 1, ctx.head_dim or 1
    itemsize = ctx.dtype.itemsize if isinstance(ctx.dtype, torch.dtype) else 2
    kv = ctx.seq_len_kv or 1
    # (block_n, most splits, widest table) of every rule a call of the bucket may take (tile_rule): the general one
    # (fp32 tiles for a quantized cache too), and SMALL_BATCH's for tables up to its width
    rules = [(block_n_for(d, size), MAX_SPLITS, kv) for size in (itemsize, 4)]
    if SMALL_BATCH is not None:
        rules.append((SMALL_BATCH[2], SMALL_BATCH[3], min(kv, SMALL_BATCH[1])))
    cap = 1
    for bn, most, width in rules:
        tiles = max(1, math.ceil(width / bn))
        cap = max(cap, min(most, tiles, max(1, tiles // MIN_TILES_PER_SPLIT)))
    sms = ctx.device.multiprocessor_count or 1
    # b' * ceil(X / b') <= X + b' - 1 for every batch b' <= b of the bucket
    rows = min(b * cap, b + math.ceil(WAVES * sms / hkv))
    return rows * hq * (d + 1) * 4


def _bad(what: str, expected: Any, got: Any, fix: str = "") -> InvalidInputError:
    return InvalidInputError(expected_got(f"{KERNEL_ID}: {what}", expected, got, fix))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float | None = None, kv_layout: str | KVLayout = "NHD", *, num_splits: int | None = None,
                 block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 k_scale: float | torch.Tensor | None = None,
                 v_scale: float | torch.Tensor | None = None, return_lse: bool = False) -> Any:
    """Split-K paged decode attention (one query token per sequence) with our Triton kernels.

    Args:
        q: ``[B, Hq, D]`` float16/bfloat16/float32, last stride 1 (as for kv_cache, block_tables, seq_lens).
        kv_cache: ``[N, 2, P, Hkv, D]`` (``kv_layout="NHD"``) or ``[N, 2, Hkv, P, D]`` (``"HND"``), q's dtype (or
            float8_e4m3fn / int8 codes: a quantized cache) and device, last stride 1; K at index 0 of dim 1, V at 1.
            Any page size P >= 1.
        block_tables: ``[B, M]`` int32; only the first ``ceil(seq_lens[b] / P)`` ids of row b are read.
        seq_lens: ``[B]`` int32 in ``[1, M * P]`` (KV tokens, the new one included); never read on the host.
        scale: softmax scale, default ``1 / sqrt(D)``.
        kv_layout: ``"NHD"`` or ``"HND"``.
        num_splits: force the number of KV splits (default: :func:`choose_split_len` from the shapes and SM count).
        block_n: KV positions per stage-1 step (power of two >= 16; default :func:`block_n_for`).
        num_warps, num_stages: stage-1 launch config (default :func:`launch_config`). Knobs for
            ``benchmarks/tune_paged_decode.py``.
        k_scale, v_scale: a quantized cache's per-tensor scales (positive floats, or 0-d / 1-element float32 tensors
            on the device, read there: graph-safe); None = 1.0. Keys and values are read as ``code * scale`` in
            float32 and both dots run in float32 (``core.kv_quant.dequantize_kv``).
        return_lse: also return each row's natural-log sum-exp ``[B, Hq]`` float32 (``triton.paged_decode_lse``).

    Returns:
        ``[B, Hq, D]`` in q's dtype (``(out, lse)`` with ``return_lse``). Cache slots past ``seq_lens[b]`` and unused
        blocks never reach it (masked loads: NaN there cannot leak).

    Raises:
        InvalidInputError: ``Hq / Hkv`` above 16, a last stride other than 1 (q, kv_cache, block_tables or
            seq_lens), ``block_n`` not a power of two >= 16
            (shapes, dtypes and index values are validated by ``lz.paged_attention`` before dispatch).
    """
    kern = _KERNELS.get()  # the @triton.jit code; triton imported fine in the backend's probe
    key = (q.shape, q.stride(), q.dtype, q.device, kv_cache.shape, kv_cache.stride(), kv_cache.dtype,
           block_tables.shape, block_tables.stride(), seq_lens.stride(), kv_layout, return_lse, num_splits, block_n,
           num_warps, num_stages)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(kern, q, kv_cache, block_tables, seq_lens, kv_layout, return_lse, num_splits, block_n,
                     num_warps, num_stages)
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    batch, hq, d = plan.out_shape
    out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, hq), dtype=torch.float32, device=q.device) if return_lse else out
    if batch == 0:
        return (out, lse) if return_lse else out
    # eager calls only: the split that finishes last merges, no stage 2 (one host launch less); under capture (and
    # lz.capture_selection) the two kernels, which replay faster (FUSED_MERGE says why; the forms agree to rounding)
    captured = AS_CAPTURED.get() or capturing_now()
    fused = plan.splits > 1 and (plan.kv_bytes <= FUSED_MERGE_MAX_BYTES if FUSED_MERGE == "auto" else FUSED_MERGE) and (
        FUSED_MERGE_IN_GRAPHS or not captured)
    if plan.splits == 1:  # stage 1 stores the output itself: no workspace, no stage 2
        ws_out = ws_lse = out
    else:  # partial outputs [B, Hq, S, D] and their lse [B, Hq, S], float32, contiguous
        ws_out = torch.empty((batch, hq, plan.splits, d), dtype=torch.float32, device=q.device)
        ws_lse = torch.empty((batch, hq, plan.splits), dtype=torch.float32, device=q.device)
    cnt = split_counters(q, batch * plan.num_kv_heads) if fused else out
    qk_scale = (1.0 / math.sqrt(d) if scale is None else float(scale)) * kern.LOG2E
    ks, vs, qflags = scale_args(plan.quant, k_scale, v_scale)
    # every int and constexpr below is the plan's: it pins the launch (FastLaunch.pinned skips Triton's binder)
    pdl = pdl_kwargs(q, batch, captured)
    launch_pinned(kern.paged_decode_split, (plan.serial, fused, bool(pdl), *qflags.values()), plan.grid,
                  q, kv_cache, block_tables, seq_lens, ws_out, ws_lse, lse, out, cnt, qk_scale, ks, vs,
                  *plan.split_ints, **(plan.fused_kw if fused else plan.split_kw), **qflags, **pdl)
    if plan.splits > 1 and not fused:
        launch_pinned(kern.paged_decode_merge, (plan.serial, bool(pdl)), (batch, hq), ws_out, ws_lse, out, lse,
                      *plan.merge_ints, **plan.merge_kw, **pdl)
    return (out, lse) if return_lse else out


class _Plan(NamedTuple):
    """What one call signature of :func:`paged_decode` (shapes, strides, dtypes, device, layout, knobs) launches with:
    everything but the tensors' addresses and the scales, worked out on its first call (``_PLANS``)."""

    serial: int  # unique per plan made (FastLaunch.pinned's pin: never reused, unlike id())
    out_shape: tuple[int, int, int]
    num_kv_heads: int
    splits: int
    kv_bytes: int  # the most K/V bytes the call can read (FUSED_MERGE "auto" compares it with FUSED_MERGE_MAX_BYTES)
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


def _plan(kern: Any, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
          kv_layout: str | KVLayout, return_lse: bool, num_splits: int | None, block_n: int | None,
          num_warps: int | None, num_stages: int | None) -> _Plan:
    """The :class:`_Plan` of a call (checks included: the raises of :func:`paged_decode`)."""
    batch, hq, d = q.shape
    _, page, hkv, _ = cache_dims(kv_cache, kv_layout)
    group = hq // hkv
    if group > MAX_GROUP:
        raise _bad("GQA group Hq / Hkv", f"<= {MAX_GROUP}", f"{hq} / {hkv} = {group}", "Let LayerZero pick "
                   "another paged kernel (torch_sdpa.paged_attention).")
    strides = (q.stride(-1), kv_cache.stride(-1), block_tables.stride(-1), seq_lens.stride(-1))
    if strides != (1, 1, 1, 1):  # the kernels index each last dim with a unit stride
        raise _bad("last strides of q, kv_cache, block_tables, seq_lens", "1 each (contiguous last dims)",
                   strides, "Call .contiguous() first (lz.paged_attention filters this kernel out instead: "
                   "STRIDE_LAST_DIM_NOT_1).")
    quant = kv_cache.dtype in KV_QUANT_DTYPES
    width, itemsize = block_tables.shape[1] * page, 4 if quant else q.element_size()
    bn, max_splits = tile_rule(batch, width, d, itemsize)
    bn = bn if block_n is None else int(block_n)
    if bn < 16 or bn & (bn - 1):
        raise _bad("block_n", "a power of two >= 16", bn)
    split_len, splits = choose_split_len(batch, hkv, width, sm_count(q.device), bn, num_splits, max_splits)
    chunks, one_pass = chunk_rule(-(-split_len // bn), block_n is None and small_batch(batch, width, d, itemsize))
    interpret = interpret_mode(kern)
    st = nhd_view(kv_cache, kv_layout).stride()  # [N, 2, P, Hkv, D] order whatever the layout
    d_pad = max(16, next_pow2(d))
    config = launch_config(d)
    if num_warps is not None:
        config["num_warps"] = int(num_warps)
    if num_stages is not None:
        config["num_stages"] = int(num_stages)
    split_kw = dict(GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=bn,
                    INTERPRET=interpret, TILES_PER_SPLIT=split_len // bn if interpret else 0,
                    UPCAST=quant or (interpret and q.dtype == torch.bfloat16), DIRECT=splits == 1,
                    WRITE_LSE=return_lse, FUSED_MERGE=False, S_PAD=1, CHUNKS=chunks, ONE_PASS=one_pass,
                    EARLY=one_pass and EARLY_KV, TRIGGER_FIRST=one_pass and "split" in TRIGGER_FIRST, **config)
    kv_bytes = batch * hkv * splits * split_len * d * 2 * kv_cache.element_size()
    # the workspace's strides (contiguous [B, Hq, S, D]); one split: the output's own ([B, Hq, D], contiguous)
    ws_strides = (hq * d, d, 0) if splits == 1 else (hq * splits * d, splits * d, d)
    return _Plan(
        next(_SERIALS), (batch, hq, d), hkv, splits, kv_bytes, quant, (batch, hkv, splits),
        (q.stride(0), q.stride(1), st[0], st[1], st[2], st[3], block_tables.stride(0), split_len, page, group, splits,
         width, *ws_strides, hq * splits),
        (hq * d, d, *ws_strides, hq, splits),
        split_kw, {**split_kw, "FUSED_MERGE": True, "S_PAD": next_pow2(splits)},
        dict(HEAD_DIM=d, D_PAD=d_pad, S_PAD=next_pow2(splits), WRITE_LSE=return_lse, num_warps=MERGE_WARPS,
             TRIGGER_FIRST=one_pass and "merge" in TRIGGER_FIRST))


def scale_args(quant: bool, k_scale: Any, v_scale: Any) -> tuple[Any, Any, dict[str, bool]]:
    """``(k_scale, v_scale, constexpr flags QUANT / K_PTR / V_PTR)`` of a paged kernel that reads a quantized cache
    (``paged_decode_split`` here, ``cascade``'s ``paged_prefill``): floats by value, tensors as pointers (read on the
    device); an unquantized cache passes 1.0 and no flags."""
    if not quant:
        return 1.0, 1.0, {}
    ks, vs = kernel_scale(k_scale), kernel_scale(v_scale)
    return ks, vs, {"QUANT": True, "K_PTR": isinstance(ks, torch.Tensor), "V_PTR": isinstance(vs, torch.Tensor)}


def paged_attention(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None,
                    v_scale=None):
    """``lz.paged_attention`` canonical-args entry (see :func:`layerzero.ops.paged.prepare`), decode only: q
    ``[B, Hq, D]`` -> ``[B, Hq, D]`` in q's dtype; ``is_causal`` changes nothing for one query token (it sees every
    key). Raises ``InvalidInputError`` for ``cu_seqlens_q`` (prefill/append; :func:`check` keeps selection from
    ever routing it here) and what :func:`paged_decode` raises."""
    _decode_only(KERNEL_ID, cu_seqlens_q)
    return paged_decode(q, kv_cache, block_tables, seq_lens, scale, kv_layout, k_scale=k_scale, v_scale=v_scale)


def paged_attention_lse(q, kv_cache, block_tables, seq_lens, cu_seqlens_q, scale, is_causal, kv_layout, k_scale=None,
                        v_scale=None):
    """``lz.paged_attention(..., return_lse=True)`` canonical-args entry, decode only (as :func:`paged_attention`):
    ``(out [B, Hq, D] in q's dtype, lse [B, Hq] float32)``."""
    _decode_only(LSE_KERNEL_ID, cu_seqlens_q)
    return paged_decode(q, kv_cache, block_tables, seq_lens, scale, kv_layout, k_scale=k_scale, v_scale=v_scale,
                        return_lse=True)


def _decode_only(kernel_id: str, cu_seqlens_q: Any) -> None:
    """Raise ``InvalidInputError`` when ``kernel_id`` (a decode-only kernel) is called with ``cu_seqlens_q``."""
    if cu_seqlens_q is not None:
        raise InvalidInputError(expected_got(
            f"{kernel_id}: cu_seqlens_q", "None (decode: one query token per sequence)", "a tensor (prefill/append)",
            f"Prefill/append runs on another paged kernel; do not lock {kernel_id} for it."))


def check(ctx: SelectionContext) -> list[Reason]:
    """What the data constraints cannot say: decode only (``ctx.phase`` DECODE), GQA ratio <= 16, a paged layout."""
    out = []
    if ctx.phase is not Phase.DECODE:
        out.append(Reason(ReasonCode.SEQ_LEN_TOO_LONG,
                          f"decode only (one query token per sequence); got phase {getattr(ctx.phase, 'value', None)} "
                          f"(cu_seqlens_q given, q_len up to {ctx.seq_len_q}): prefill/append run on other kernels"))
    ratio = ctx.gqa_ratio
    if ratio is not None and ratio > MAX_GROUP:
        out.append(Reason(ReasonCode.GQA_RATIO_INVALID,
                          f"Hq / Hkv = {ratio} > {MAX_GROUP} (one GQA group per tile)"))
    if ctx.kv_layout not in KV_LAYOUTS:
        out.append(Reason(ReasonCode.KV_LAYOUT_UNSUPPORTED, f"kv_layout {ctx.kv_layout!r} is not NHD or HND"))
    if ctx.page_size is not None and ctx.page_size < 1:
        out.append(Reason(ReasonCode.SHAPE_MISMATCH, f"page size {ctx.page_size} < 1"))
    return out


def kernel_specs(available: bool, why: str) -> list[KernelSpec]:
    """The Triton paged KernelSpecs: ``triton.paged_decode`` (op ``paged_attention``, CUDA SM >= 8.0, fp16/bf16/
    fp32, head dims 1..256, NHD and HND, any page size, GQA 1..16, decode only, graph-safe, deterministic,
    priority 40), ``triton.paged_decode_lse`` (the same for op ``paged_attention_lse``), then the cascade kernels
    (``triton.paged_prefill_lse``, ``triton.merge_attention_states``: :mod:`.cascade`). When ``available`` is False
    the specs are still registered and their callables raise ``BackendNotAvailableError`` with ``why``."""
    from . import cascade

    common: dict[str, Any] = dict(
        priority=PRIORITY, device_types=CUDA, dtypes=FLOATS, sm_min=SM_MIN, head_dim_min=1, head_dim_max=HEAD_DIM_MAX,
        supports_backward=False, supports_dropout=False, requires_stride_last_1=True, deterministic=True,
        graph_safe=True, check=check, workspace=workspace_bytes, kv_cache_dtypes=KV_QUANT_DTYPES)
    return [
        KernelSpec(KERNEL_ID, "paged_attention", paged_attention if available else missing(KERNEL_ID, why),
                   description="Triton split-K paged decode (FlashDecoding): per (sequence, KV head, split) online "
                               "softmax over the used pages, GQA group as one tile, then a log-sum-exp merge",
                   **common),
        KernelSpec(LSE_KERNEL_ID, "paged_attention_lse",
                   paged_attention_lse if available else missing(LSE_KERNEL_ID, why),
                   description="triton.paged_decode returning each row's log-sum-exp too (the split merge's lse)",
                   **common),
        *cascade.kernel_specs(available, why),
    ]
