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
    ``max_blocks`` blocks each."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], max_num_seqs: int, max_blocks: int,
                 device: torch.device) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids, self.positions = torch.zeros(n, **i64), torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.block_tables = torch.zeros(n, max_blocks, **i32)
        self.seq_lens = torch.ones(n, **i32)
        self.rows = torch.arange(n, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(self.input_ids[:bs], self.positions[:bs], self.slot_mapping[:bs], self.block_tables[:bs],
                            self.seq_lens[:bs], None, self.rows[:bs], bs)

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
        for bs in reversed(self.sizes):
            batch = self._batch(bs)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model(batch, self.kv_caches)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(batch, self.kv_caches)
            pool = graph.pool()
            self.graphs[bs] = graph

    def can_run(self, batch: ForwardBatch) -> bool:
        """A pure decode step (not a cascade one) that fits the largest bucket."""
        return bool(self.graphs) and batch.is_decode and batch.cascade is None and batch.num_seqs <= self.sizes[-1] \
            and batch.block_tables.shape[1] <= self.block_tables.shape[1]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the smallest bucket that holds ``batch``; returns its logits ``[B, V]`` (every decode row is
        sampled)."""
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
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
