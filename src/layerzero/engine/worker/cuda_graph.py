"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up over static metadata
buffers, replayed with the step's metadata copied in and the batch padded up to the bucket (vLLM's and
nano-vllm's scheme).

Capture follows PyTorch's recipe: an eager warm-up on a side stream, under ``lz.capture_selection()`` (so
LayerZero selects, and warms, the kernels a capture of these inputs uses: graph-safe ones, scored for in-graph
time; eager decode steps select the same way, so graphs and eager give the same tokens), then
``torch.cuda.graph`` with one memory pool shared by every bucket, largest first. Padded rows write no KV (slot
-1), attend over one token of block 0 and their logits are dropped; rows are independent, so they cannot
change the real rows.

Small buckets read their inputs from packed buffers (``packed_inputs``), two per bucket (``lanes``) taken by
alternate steps, and also capture greedy graphs (``greedy_in_graph``: sampling inside the replay, the ids
written into the other lane for the next step): between two steady greedy decode steps the GPU then only waits
for a copy made while the step before ran. A graph's pool tensors are only read right after its own replay
(the pool is shared: one graph's output may be another's scratch); what outlives a replay lives in static
buffers. These choices are the fields of :class:`~layerzero.engine.config.CudaGraphKnobs`
(``EngineConfig.cuda_graph``), read when a runner is built.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

import layerzero as lz

from ..config import CudaGraphKnobs
from .attn_metadata import CascadeBatch, ForwardBatch
from .staging import offsets

__all__ = ["CUDAGraphRunner", "PackTarget", "capture_sizes"]

log = logging.getLogger("layerzero.engine")


class PackTarget(NamedTuple):
    """Where a packed decode step's inputs go: bucket ``bs`` (rows), the graphs' block-table ``width``, the
    lane's uint8 ``buffer`` (layout: :func:`pack_nbytes`, the :func:`~layerzero.engine.staging.offsets` of its
    arrays), ``rows`` (a device arange of at least ``bs``: the batch's ``logits_indices``), ``views``: the
    lane's (ids, positions, slot mapping, block tables, seq_lens) views of ``buffer``, what its graphs read
    (made once), its ``lane`` (the knob ``lanes``; the previous lane's greedy graph, if any, writes its
    sampled ids into this lane's id slots ``views[0]`` and hands those slots out, so a step whose
    ``prev_tokens`` are these is chained). CUDA only (None on CPU): ``h2d``, the side stream a chained step's
    inputs are copied on (None with ``h2d_aside`` off), ``free``, an event recorded after every replay that
    reads this lane, and ``sent``, one recorded after every transfer of its id slots to the host
    (:meth:`wait_sent`)."""

    bs: int
    width: int
    buffer: torch.Tensor
    rows: torch.Tensor
    views: tuple[torch.Tensor, ...]
    lane: int = 0
    h2d: Any = None
    free: Any = None
    sent: Any = None

    def wait_sent(self) -> None:
        """Make the current stream wait until the last transfer of this lane's id slots to the host has read
        them: call before anything overwrites them. Nothing on CPU."""
        if self.sent is not None:
            torch.cuda.current_stream(self.buffer.device).wait_event(self.sent)


def pack_nbytes(bs: int, width: int) -> list[int]:
    """Bytes of a packed bucket's arrays, in order: input ids, positions, slot mapping (int64 ``[bs]`` each),
    block tables (int32 ``[bs, width]``), seq_lens (int32 ``[bs]``), pending-id rows (int64
    ``[2, <= bs]``)."""
    return [8 * bs, 8 * bs, 8 * bs, 4 * bs * width, 4 * bs, 16 * bs]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (vLLM's list), and
    ``max_num_seqs`` itself."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


class CUDAGraphRunner:
    """Decode graphs of ``model`` over ``kv_caches`` for up to ``max_num_seqs`` sequences of up to
    ``max_blocks`` blocks each; with ``cascade``, a second graph per bucket runs cascade-attention decode
    steps (:mod:`.cascade`) over static cascade buffers padded to the bucket. ``knobs``: the engine's
    :class:`~layerzero.engine.config.CudaGraphKnobs` (None: the defaults)."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks: int,
        device: torch.device,
        cascade: bool = False,
        knobs: CudaGraphKnobs | None = None,
    ) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.knobs = knobs = CudaGraphKnobs() if knobs is None else knobs
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids, self.positions = torch.zeros(n, **i64), torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.block_tables = torch.zeros(n, max_blocks, **i32)
        self.seq_lens = torch.ones(n, **i32)
        self.rows = torch.arange(n + 1, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.cascade: _CascadeBuffers | None = _CascadeBuffers(n, max_blocks, device) if cascade else None
        self.cascade_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.cascade_outputs: dict[int, torch.Tensor] = {}
        self.lane_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        """(packed bucket, lane) -> its plain graph (lane 0's is also ``graphs[bucket]``); logits in
        ``lane_outputs``."""
        self.lane_outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.greedy_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        """(packed bucket, lane) -> its greedy graph (``greedy_in_graph``); logits in ``greedy_outputs``, the
        ids in the next lane's id slots."""
        self.greedy_outputs: dict[tuple[int, int], torch.Tensor] = {}
        cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if cuda and knobs.h2d_aside else None
        """Side stream of chained steps' input copies (CUDA)."""
        self.d2h = torch.cuda.Stream(device) if cuda and knobs.d2h_aside else None
        """Side stream of greedy graphs' ids on their way to the host (CUDA)."""
        self.packs: dict[int, list[torch.Tensor]] = {}
        """Bucket -> its lanes' packed input buffers (``packed_inputs``; small buckets only; ``lanes`` of them
        up to ``lane_max_batch`` rows, one above)."""
        self._targets: dict[tuple[int, int], PackTarget] = {}
        """(bucket, lane) -> its :class:`PackTarget` (the buffer and the views its graphs read, made once)."""
        if knobs.packed_inputs:
            for bs in self.sizes:
                sizes = pack_nbytes(bs, max_blocks)
                offs, need = offsets(sizes)
                if need <= knobs.pack_max_bytes:
                    lanes = knobs.lanes if bs <= knobs.lane_max_batch else 1
                    self.packs[bs] = [
                        self._pack(bs, lane, sizes, offs, need, max_blocks) for lane in range(lanes)
                    ]

    def _pack(
        self, bs: int, lane: int, sizes: list[int], offs: list[int], need: int, width: int
    ) -> torch.Tensor:
        """A lane's packed buffer of bucket ``bs`` and its :class:`PackTarget`."""
        buf = torch.zeros(need, dtype=torch.uint8, device=self.device)
        i64 = [buf[o : o + n].view(torch.int64) for o, n in zip(offs[:3], sizes[:3], strict=True)]
        tables = buf[offs[3] : offs[3] + sizes[3]].view(torch.int32).view(bs, width)
        views = (*i64, tables, buf[offs[4] : offs[4] + sizes[4]].view(torch.int32))
        views[2].fill_(-1)  # slots and seq_lens: the values a padded row has (a capture's dummy step)
        views[4].fill_(1)
        free, sent = (torch.cuda.Event(), torch.cuda.Event()) if self.device.type == "cuda" else (None, None)
        self._targets[bs, lane] = PackTarget(bs, width, buf, self.rows, views, lane, self.h2d, free, sent)
        return buf

    def _packed_views(self, bs: int, lane: int = 0) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slot mapping, block tables, seq_lens) of bucket ``bs``'s packed buffer of
        ``lane``."""
        return self._targets[bs, lane].views

    def _batch(self, bs: int, cascade: bool = False, lane: int = 0) -> ForwardBatch:
        if bs in self.packs and not cascade:
            ids, pos, slots, tables, lens = self._packed_views(bs, lane)
            return ForwardBatch(
                ids, pos, slots, tables, lens, None, self.rows[:bs], bs, None, graphed=True, logits_all=True
            )
        return ForwardBatch(
            self.input_ids[:bs],
            self.positions[:bs],
            self.slot_mapping[:bs],
            self.block_tables[:bs],
            self.seq_lens[:bs],
            None,
            self.rows[:bs],
            bs,
            self.cascade.batch(bs) if cascade else None,
            graphed=True,
            logits_all=True,
        )

    def run_greedy(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any] | None:
        """Replay the greedy graph of a packed ``batch``'s bucket and lane: (logits ``[B, V]``, the rows'
        argmax ids ``[B]`` int64 (``lz.sample_greedy``'s) in the next lane's id slots, their host copy in
        transfer (on the ``d2h`` side stream with ``d2h_aside``), the event after it, None on CPU). None
        (nothing run) for a batch that is not packed or a bucket without greedy graphs.

        The ids are handed out where the graph wrote them, a static buffer, not in the graphs' memory pool: a
        pool tensor of one graph may be another graph's scratch, and the transfer may run while the next
        step's graph (the other lane's) does."""
        if not batch.packed:
            return None
        n = batch.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        graph = self.greedy_graphs.get((bs, batch.lane))
        if graph is None:
            return None
        other = self._targets[bs, (batch.lane + 1) % self.knobs.lanes]
        # the id slots this replay overwrites: their last transfer (two steps ago) read them
        other.wait_sent()
        self._replay(graph, bs, batch.lane)
        logits, tokens = self.greedy_outputs[bs, batch.lane][:n], other.views[0][:n]
        if self.device.type != "cuda":
            return logits, tokens, tokens.clone(), None
        stream = torch.cuda.current_stream(self.device)
        if self.d2h is not None:
            self.d2h.wait_stream(stream)
            stream = self.d2h
        with torch.cuda.stream(stream):
            host = tokens.to("cpu", non_blocking=True)
            other.sent.record()
            event = torch.cuda.Event()
            event.record()
        return logits, tokens, host, event

    def _replay(self, graph: Any, bs: int, lane: int) -> None:
        """Replay ``graph``, which reads lane ``lane`` of bucket ``bs``, and record that lane's ``free``
        event."""
        graph.replay()
        free = self._targets[bs, lane].free
        if free is not None:
            free.record()

    def pack_for(self, num_seqs: int, width: int, lane: int = 0) -> PackTarget | None:
        """Lane ``lane`` of the packed bucket a decode step of ``num_seqs`` sequences (every one sampled)
        whose block tables are ``width`` wide would replay, or None (no such bucket: the step's rows are
        copied in by :meth:`run`)."""
        if not self.graphs or num_seqs > self.sizes[-1] or width > self.block_tables.shape[1]:
            return None
        bs = next(s for s in self.sizes if s >= num_seqs)
        return self._targets.get((bs, lane % len(self.packs[bs]))) if bs in self.packs else None

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket (largest first, one shared memory pool)."""
        with lz.capture_selection():  # the warm-up selects what the capture uses (same keys)
            self._capture_all()
        torch.cuda.synchronize(self.device)
        log.info("CUDA graphs captured for decode batch sizes %s", self.sizes)

    @torch.no_grad()
    def warm_as_captured(self) -> None:
        """Run the smallest bucket's dummy decode batch once, eagerly, under ``lz.capture_selection()``:
        selects (and warms) the kernels the graphs would run, without capturing (``enforce_eager``).

        Raises:
            NoKernelFoundError: no graph-safe kernel can run an op of a decode step here.
        """
        with lz.capture_selection():
            self.model(self._batch(self.sizes[0]), self.kv_caches)
        torch.cuda.synchronize(self.device)

    def _capture_all(self) -> None:
        pool = None
        # one side stream for every bucket's warm-up: torch keeps a cuBLAS workspace per stream the GEMMs ran
        # on (32-64 MiB on Hopper, until torch._C._cuda_clearCublasWorkspaces()), so a stream per bucket could
        # pin one each
        side = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):
            for kind, lane in self._kinds(bs):
                batch = self._batch(bs, kind == "cascade", lane)
                step = partial(self._greedy_step, lane) if kind == "greedy" else self.model
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        step(batch, self.kv_caches)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = step(batch, self.kv_caches)
                pool = graph.pool()
                self._keep(bs, kind, lane, graph, out)

    def _kinds(self, bs: int) -> list[tuple[str, int]]:
        """The (kind, lane) graphs bucket ``bs`` captures: a plain graph (one per lane of a packed bucket), a
        greedy graph per lane of a bucket with ``lanes`` lanes, two or more (``greedy_in_graph``), a cascade
        graph (with cascade buffers)."""
        lanes = len(self.packs[bs]) if bs in self.packs else 1
        kinds = [("plain", lane) for lane in range(lanes)]
        if self.knobs.greedy_in_graph and lanes == self.knobs.lanes >= 2:
            kinds += [("greedy", lane) for lane in range(lanes)]
        return kinds + ([("cascade", 0)] if self.cascade is not None else [])

    def _keep(self, bs: int, kind: str, lane: int, graph: torch.cuda.CUDAGraph, out: Any) -> None:
        """File a captured graph and its output(s) under (``bs``, ``lane``) by ``kind``."""
        if kind == "greedy":  # its ids go to the other lane's id slots (what a chained step there reads)
            self.greedy_graphs[bs, lane], self.greedy_outputs[bs, lane] = graph, out
        elif kind == "cascade":
            self.cascade_graphs[bs], self.cascade_outputs[bs] = graph, out
        else:
            if bs in self.packs:
                self.lane_graphs[bs, lane], self.lane_outputs[bs, lane] = graph, out
            if lane == 0:
                self.graphs[bs], self.outputs[bs] = graph, out

    def _greedy_step(self, lane: int, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """A greedy graph's work on ``lane``'s inputs: the forward, ``lz.sample_greedy`` of every row, the ids
        copied into the next lane's id slots (what a chained next step reads, and what the caller gets).
        Returns the logits ``[bs, V]``."""
        logits = self.model(batch, kv_caches)
        self._targets[batch.num_seqs, (lane + 1) % self.knobs.lanes].views[0].copy_(lz.sample_greedy(logits))
        return logits

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode step (a cascade one only with cascade graphs) that fits the largest bucket and
        samples every row (the graphs return every row's logits; a one-token chunk that does not end its
        prompt, from a budget's last token, runs eager)."""
        return (
            bool(self.graphs)
            and batch.is_decode
            and batch.num_seqs <= self.sizes[-1]
            and batch.logits_indices.shape[0] == batch.num_seqs
            and batch.block_tables.shape[1] <= self.block_tables.shape[1]
            and (batch.cascade is None or bool(self.cascade_graphs))
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the smallest bucket that holds ``batch`` (its cascade graph for a cascade step); returns its
        logits ``[B, V]`` (every decode row is sampled)."""
        n = batch.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        if batch.packed and (bs, batch.lane) in self.lane_graphs:
            # its tensors are views of this runner's lane buffer, written by the step's one copy; a batch
            # packed for another runner (a draft model replaying the target's step) is copied in as any batch
            # below
            self._replay(self.lane_graphs[bs, batch.lane], bs, batch.lane)
            return self.lane_outputs[bs, batch.lane][:n]
        w = batch.block_tables.shape[1]
        if (
            batch.cascade is None and bs in self.packs
        ):  # a packed bucket's graph reads its own buffer (lane 0's)
            ids, pos, slots, tables, lens = self._packed_views(bs)
            self._targets[
                bs, 0
            ].wait_sent()  # the ids overwritten below may still be on their way to the host
        else:
            ids, pos, slots, tables, lens = (
                self.input_ids,
                self.positions,
                self.slot_mapping,
                self.block_tables,
                self.seq_lens,
            )
        ids[:n].copy_(batch.input_ids)
        pos[:n].copy_(batch.positions)
        slots[:n].copy_(batch.slot_mapping)
        slots[n:bs].fill_(-1)
        tables[:n, :w].copy_(batch.block_tables)
        tables[n:bs].zero_()
        lens[:n].copy_(batch.seq_lens)
        lens[n:bs].fill_(1)
        if batch.cascade is not None:
            self.cascade.load(batch.cascade, n, bs, w, self.rows)
            self.cascade_graphs[bs].replay()
            return self.cascade_outputs[bs][:n]
        if bs in self.packs:  # lane 0's plain graph, which reads the buffer just written
            self._replay(self.graphs[bs], bs, 0)
        else:
            self.graphs[bs].replay()
        return self.outputs[bs][:n]


class _CascadeBuffers:
    """Static cascade metadata of the cascade graphs (:class:`~.cascade.CascadeBatch` padded to a bucket of
    ``bs`` rows): every padded row ``i >= n`` is its own group with an empty prefix and attends one token of
    block 0 (as a padded plain-decode row); the groups past the real ones and the padded rows' are empty
    (``cu_prefix`` stays at ``bs``). Initially every row is a group of one: a valid step for the capture."""

    def __init__(self, n: int, max_blocks: int, device: torch.device) -> None:
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.rows = torch.arange(n, **i64)
        self.prefix_tables = torch.zeros(n, max_blocks, **i32)
        self.prefix_lens = torch.zeros(n, **i32)
        self.cu_prefix = torch.arange(n + 1, **i32)
        self.suffix_tables = torch.zeros(n, max_blocks, **i32)
        self.suffix_lens = torch.ones(n, **i32)

    def batch(self, bs: int) -> CascadeBatch:
        """The bucket's view of the buffers."""
        return CascadeBatch(
            self.rows[:bs],
            self.prefix_tables[:bs],
            self.prefix_lens[:bs],
            self.cu_prefix[: bs + 1],
            self.suffix_tables[:bs],
            self.suffix_lens[:bs],
            0,
        )

    def load(self, c: CascadeBatch, n: int, bs: int, width: int, arange: torch.Tensor) -> None:
        """Copy a step's cascade metadata (``n`` rows, block-table width ``width``) into the bucket of ``bs``
        rows; ``arange`` is a device ``arange`` of at least ``bs + 1`` int64."""
        g, k = c.prefix_tables.shape
        pad = bs - n
        self.rows[:n].copy_(c.rows)
        self.rows[n:bs].copy_(arange[n:bs])
        self.prefix_tables[:g, :k].copy_(c.prefix_tables)
        self.prefix_lens[:g].copy_(c.prefix_lens)
        self.prefix_lens[g:bs].zero_()
        self.cu_prefix[: g + 1].copy_(c.cu_prefix)
        self.cu_prefix[g + 1 : g + 1 + pad].copy_(arange[n + 1 : bs + 1])  # a group of one per padded row
        self.cu_prefix[g + 1 + pad : bs + 1].fill_(bs)
        self.suffix_tables[:n, :width].copy_(c.suffix_tables)
        self.suffix_tables[n:bs].zero_()
        self.suffix_lens[:n].copy_(c.suffix_lens)
        self.suffix_lens[n:bs].fill_(1)
