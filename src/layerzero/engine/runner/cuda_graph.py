"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up over static metadata
buffers, replayed with the step's metadata copied in and the batch padded up to the bucket (vLLM's and
nano-vllm's scheme).

Capture follows PyTorch's recipe: an eager warm-up on a side stream, under ``lz.capture_selection()`` (so LayerZero
selects, and warms, the kernels a capture of these inputs uses: graph-safe ones, scored for in-graph time; eager
decode steps select the same way, so graphs and eager give the same tokens), then ``torch.cuda.graph`` with one memory pool
shared by every bucket, largest first. Padded rows write no KV (slot -1), attend over one token of block 0 and
their logits are dropped; rows are independent, so they cannot change the real rows.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import layerzero as lz

from .cascade import CascadeBatch
from .forward_batch import ForwardBatch

__all__ = ["CUDAGraphRunner", "capture_sizes"]

log = logging.getLogger("layerzero.engine")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (vLLM's list), and
    ``max_num_seqs`` itself."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


class CUDAGraphRunner:
    """Decode graphs of ``model`` over ``kv_caches`` for up to ``max_num_seqs`` sequences of up to
    ``max_blocks`` blocks each; with ``cascade``, a second graph per bucket runs cascade-attention decode steps
    (:mod:`.cascade`) over static cascade buffers padded to the bucket."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_num_seqs: int, max_blocks: int,
                 device: torch.device, cascade: bool = False) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
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

    def _batch(self, bs: int, cascade: bool = False) -> ForwardBatch:
        return ForwardBatch(self.input_ids[:bs], self.positions[:bs], self.slot_mapping[:bs], self.block_tables[:bs],
                            self.seq_lens[:bs], None, self.rows[:bs], bs,
                            self.cascade.batch(bs) if cascade else None, graphed=True)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket (largest first, one shared memory pool)."""
        with lz.capture_selection():  # the warm-up selects what the capture uses (same keys)
            self._capture_all()
        torch.cuda.synchronize(self.device)
        log.info("CUDA graphs captured for decode batch sizes %s", self.sizes)

    @torch.no_grad()
    def warm_as_captured(self) -> None:
        """Run the smallest bucket's dummy decode batch once, eagerly, under ``lz.capture_selection()``: selects (and
        warms) the kernels the graphs would run, without capturing (``enforce_eager``).

        Raises:
            NoKernelFoundError: no graph-safe kernel can run an op of a decode step here.
        """
        with lz.capture_selection():
            self.model(self._batch(self.sizes[0]), self.kv_caches)
        torch.cuda.synchronize(self.device)

    def _capture_all(self) -> None:
        pool = None
        # one side stream for every bucket's warm-up: torch keeps a cuBLAS workspace per stream the GEMMs ran on (32-64
        # MiB on Hopper, until torch._C._cuda_clearCublasWorkspaces()), so a stream per bucket could pin one each
        side = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):
            for cascade in (False, True) if self.cascade is not None else (False,):
                batch = self._batch(bs, cascade)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self.model(batch, self.kv_caches)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(batch, self.kv_caches)
                pool = graph.pool()
                (self.cascade_graphs if cascade else self.graphs)[bs] = graph
                (self.cascade_outputs if cascade else self.outputs)[bs] = out

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode step (a cascade one only with cascade graphs) that fits the largest bucket and samples
        every row (the graphs return every row's logits; a one-token chunk that does not end its prompt, from a
        budget's last token, runs eager)."""
        return bool(self.graphs) and batch.is_decode and batch.num_seqs <= self.sizes[-1] \
            and batch.logits_indices.shape[0] == batch.num_seqs \
            and batch.block_tables.shape[1] <= self.block_tables.shape[1] \
            and (batch.cascade is None or bool(self.cascade_graphs))

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the smallest bucket that holds ``batch`` (its cascade graph for a cascade step); returns its logits
        ``[B, V]`` (every decode row is sampled)."""
        n = batch.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        w = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.block_tables[:n, :w].copy_(batch.block_tables)
        self.block_tables[n:bs].zero_()
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        if batch.cascade is not None:
            self.cascade.load(batch.cascade, n, bs, w, self.rows)
            self.cascade_graphs[bs].replay()
            return self.cascade_outputs[bs][:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


class _CascadeBuffers:
    """Static cascade metadata of the cascade graphs (:class:`~.cascade.CascadeBatch` padded to a bucket of ``bs``
    rows): every padded row ``i >= n`` is its own group with an empty prefix and attends one token of block 0 (as a
    padded plain-decode row); the groups past the real ones and the padded rows' are empty (``cu_prefix`` stays at
    ``bs``). Initially every row is a group of one: a valid step for the capture."""

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
        return CascadeBatch(self.rows[:bs], self.prefix_tables[:bs], self.prefix_lens[:bs], self.cu_prefix[:bs + 1],
                            self.suffix_tables[:bs], self.suffix_lens[:bs], 0)

    def load(self, c: CascadeBatch, n: int, bs: int, width: int, arange: torch.Tensor) -> None:
        """Copy a step's cascade metadata (``n`` rows, block-table width ``width``) into the bucket of ``bs`` rows;
        ``arange`` is a device ``arange`` of at least ``bs + 1`` int64."""
        g, k = c.prefix_tables.shape
        pad = bs - n
        self.rows[:n].copy_(c.rows)
        self.rows[n:bs].copy_(arange[n:bs])
        self.prefix_tables[:g, :k].copy_(c.prefix_tables)
        self.prefix_lens[:g].copy_(c.prefix_lens)
        self.prefix_lens[g:bs].zero_()
        self.cu_prefix[:g + 1].copy_(c.cu_prefix)
        self.cu_prefix[g + 1:g + 1 + pad].copy_(arange[n + 1:bs + 1])  # a group of one per padded row
        self.cu_prefix[g + 1 + pad:bs + 1].fill_(bs)
        self.suffix_tables[:n, :width].copy_(c.suffix_tables)
        self.suffix_tables[n:bs].zero_()
        self.suffix_lens[:n].copy_(c.suffix_lens)
        self.suffix_lens[n:bs].fill_(1)
