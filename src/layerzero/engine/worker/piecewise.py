"""Piecewise CUDA graphs for steps with prefill tokens (vLLM's piecewise CUDA graphs, built by hand).

An eager step of a few hundred tokens is bound by the host: each layer launches about ten kernels, each
through LayerZero's dispatch and often a Triton launcher (tens of µs each on the H200's host), while the
GPU works a few µs per kernel. The decode graphs (:mod:`.cuda_graph`) cannot hold such steps: their
attention is a prefill (varlen, chunked, mixed with decode rows) whose kernels plan on the host.

So a step of T <= ``sizes[-1]`` tokens with prefill chunks replays the bucket of the smallest size >= T:
L + 1 graphs, split at every attention call. Piece 0 holds the embedding and the first layer up to its
attention's inputs; piece i (0 < i < L) the rest of layer i - 1 and the start of layer i; piece L the last
layer's rest, the final norm and the LM head of the sampled rows. Between two pieces the layer's attention
(the KV write, paged or cascade attention) runs eagerly on the step's own :class:`ForwardBatch`, so it may
plan on the host, read lengths and need no graph safety; its q / k / v reach it through static buffers the
piece before writes (copies inside that piece), its output through a static buffer the piece after reads.
Those buffers are sized for the largest bucket and shared by every layer and bucket: one layer's attention
reads them before the next piece overwrites them.

Padding: the bucket's input ids and positions past T keep earlier (valid) values; the attention sees only
the T real rows, the padded rows' attention output keeps stale finite values; every op inside a piece is
row-wise (linears, norms, RoPE, SwiGLU, MoE routing), so padded rows never touch real ones. Sampled rows:
``logits_indices`` copied into a static row buffer, padded with row 0.

Capture: largest bucket first, one memory pool of their own; each bucket warms up eagerly twice under
``lz.capture_selection()`` (graph-safe kernels for the pieces, scored for in-graph time; each attention
call under ``lz.capture_selection(False)``, as its replay selects), then captures on a side stream. The
graphs come from ``new_graph`` (``torch.cuda.CUDAGraph``; tests pass a stand-in to run the same logic on
the CPU). On by default at any tensor-parallel size (``CudaGraphKnobs.piecewise_max_tokens`` None: up to
1,024 tokens; :func:`piecewise_tokens`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import replace
from typing import Any

import torch
from torch import nn

import layerzero as lz
from layerzero import InvalidInputError

from ..config import PIECEWISE_AUTO_TOKENS, EngineConfig
from .attn_metadata import ForwardBatch
from .input_batch import ScheduledChunk, build_forward_batch

__all__ = ["PiecewiseGraphs", "piecewise_sizes", "piecewise_tokens"]

log = logging.getLogger("layerzero.engine")


def piecewise_tokens(ec: EngineConfig) -> int:
    """The largest step (tokens) piecewise graphs hold for ``ec``: ``CudaGraphKnobs.piecewise_max_tokens``
    when set, else (auto) :data:`~layerzero.engine.config.PIECEWISE_AUTO_TOKENS`, at any
    ``tensor_parallel_size`` (the two-H200 test of TP = 2 with pieces against TP = 1 passed, 2026-11-29).
    0: off."""
    if ec.cuda_graph.piecewise_max_tokens is not None:
        return ec.cuda_graph.piecewise_max_tokens
    return PIECEWISE_AUTO_TOKENS


def piecewise_sizes(max_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """Token buckets: 16, 32, 64, ... doubling, then ``max_tokens`` itself, none above ``max_tokens`` or the
    step budget ``max_num_batched_tokens``; [] when ``max_tokens`` < 1 (vLLM captures its piecewise graphs
    at a ladder of sizes likewise, up to 512 by default)."""
    top = min(max_tokens, max_num_batched_tokens)
    sizes, s = [], 16
    while s < top:
        sizes.append(s)
        s *= 2
    return sizes + [top] if top >= 1 else []


class PiecewiseGraphs:
    """The piecewise graphs of one model (see the module docstring).

    ``model``: a decoder whose attention layers call :func:`layerzero.engine.layers.attention.paged_attention`
    (which hands the call to :meth:`attend` while ``batch.pieces`` is set); ``kv_caches``: its pools;
    ``sizes``: token buckets, ascending; ``max_rows``: the most sampled rows a step has (``max_num_seqs``,
    times 1 + k with speculation); ``block_size``: the pools' block size; ``new_graph``: makes an empty graph
    (``torch.cuda.CUDAGraph`` on CUDA).

    Raises:
        InvalidInputError: no bucket, or one below 1 token (take them from :func:`piecewise_sizes`)."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        max_rows: int,
        block_size: int,
        device: torch.device,
        new_graph: Callable[[], Any] | None = None,
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise InvalidInputError(
                f"PiecewiseGraphs sizes: expected token buckets >= 1, got {sizes!r}. Build them with "
                "piecewise_sizes(max_tokens >= 1, max_num_batched_tokens)."
            )
        self.model, self.kv_caches, self.sizes = model, kv_caches, sorted(sizes)
        self.block_size, self.device = block_size, device
        self.rows_cap = {t: min(t, max_rows) for t in self.sizes}
        top = self.sizes[-1]
        self.ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.rows = torch.zeros(self.rows_cap[top], dtype=torch.int64, device=device)
        self.new_graph = new_graph or torch.cuda.CUDAGraph
        self.graphs: dict[int, list[Any]] = {}
        """Per bucket: its L + 1 graphs, in replay order."""
        self.logits: dict[int, torch.Tensor] = {}
        """Per bucket: the last piece's logits ``[rows_cap, V]`` (its memory pool's; read right after a
        replay)."""
        self.attention: list[Callable[..., torch.Tensor]] = []
        """Per layer: its attention call (``fn(q, k, v, batch=...)``), as the model hands it over."""
        self.static: tuple[torch.Tensor, ...] | None = None
        """q, k, v, attention output: ``[sizes[-1], heads, D]`` buffers shared by every layer and bucket."""
        # "warm", "capture" or "as-replayed" while the model runs through attend
        self._mode: str | None = None
        self._eager: ForwardBatch | None = None  # what the attention calls of a warm-up / capture read
        self._piece: list[Any] = []  # the graphs of the capture in progress
        self._layer = 0  # attention calls so far in the warm-up / capture forward
        self._capturing = False
        self._pool: Any = None

    # ----------------------------------------------------------------------------------------------------
    def can_run(self, batch: ForwardBatch) -> bool:
        """A step with prefill chunks (not a pure decode step, which the decode graphs or eager take) of at
        most ``sizes[-1]`` tokens whose sampled rows fit its bucket, once captured."""
        t = batch.input_ids.shape[0]
        if not self.graphs or batch.is_decode or batch.packed or t > self.sizes[-1]:
            return False
        return batch.logits_indices.shape[0] <= self.rows_cap[self._bucket(t)]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the bucket that holds ``batch``: its inputs copied in, each piece replayed, each layer's
        attention run eagerly on ``batch`` between them. Returns the logits ``[S, V]`` of
        ``batch.logits_indices`` (model dtype; a view of the bucket's output, valid until the next replay)."""
        t, s = batch.input_ids.shape[0], batch.logits_indices.shape[0]
        size = self._bucket(t)
        self.ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        rows = self.rows[: self.rows_cap[size]]
        if s < rows.shape[0]:
            rows[s:].zero_()
        rows[:s].copy_(batch.logits_indices)
        q, k, v, o = self.static
        graphs = self.graphs[size]
        for graph, attend in zip(graphs, self.attention, strict=False):
            graph.replay()
            o[:t].copy_(attend(q[:t], k[:t], v[:t], batch=batch))
        graphs[-1].replay()
        return self.logits[size][:s]

    def _bucket(self, t: int) -> int:
        return next(s for s in self.sizes if s >= t)

    # ----------------------------------------------------------------------------------------------------
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """One attention call of a warm-up or capture (``batch.pieces`` is this object): q ``[T, Hq, D]``, k /
        v ``[T, Hkv, D]``; ``fn(q, k, v, batch=...)`` runs the layer's attention. Warm-up (and
        :meth:`forward_as_replayed`): runs it eagerly on the step's metadata. Capture: copies q / k / v into
        the static buffers (the end of the current piece), ends the piece, runs ``fn`` eagerly on the buffers,
        copies its output into the static output buffer and starts the next piece, which reads it, and returns
        that buffer's first T rows."""
        t = q.shape[0]
        if self._mode == "warm":
            if self.static is None:  # shapes from the first call (the largest bucket warms up first)
                top = self.sizes[-1]
                self.static = tuple(
                    torch.zeros((top, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in (q, k, v, q)
                )
            if self._layer == len(self.attention):  # the first warm-up files each layer's call
                self.attention.append(fn)
            self._layer += 1
        if self._mode in ("warm", "as-replayed"):
            with lz.capture_selection(False):  # as its replay selects: eagerly
                return fn(q, k, v, batch=self._eager)
        sq, sk, sv, so = self.static
        sq[:t].copy_(q)
        sk[:t].copy_(k)
        sv[:t].copy_(v)
        self._end()
        with lz.capture_selection(False):
            so[:t].copy_(self.attention[self._layer](sq[:t], sk[:t], sv[:t], batch=self._eager))
        self._layer += 1
        self._begin()
        return so[:t]

    def forward_as_replayed(self, batch: ForwardBatch) -> torch.Tensor:
        """An eager forward of ``batch`` that selects every kernel as a replay of its bucket runs it: the ops
        inside the pieces under ``lz.capture_selection()``, each attention call eagerly. Nothing is captured
        or replayed; for ``lz.dry_run`` reports (``ModelRunner.kernel_report``). Returns the logits of
        ``batch.logits_indices``."""
        self._mode, self._eager = "as-replayed", batch
        try:
            with lz.capture_selection():
                return self.model(replace(batch, pieces=self), self.kv_caches)
        finally:
            self._mode, self._eager = None, None

    def _begin(self) -> None:
        graph = self.new_graph()
        graph.capture_begin(pool=self._pool)
        self._capturing = True
        self._piece.append(graph)

    def _end(self) -> None:
        self._piece[-1].capture_end()
        self._capturing = False
        if self._pool is None:  # a graph names its pool only after a capture ended (CUDAGraph::pool)
            self._pool = self._piece[-1].pool()

    # ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (see the module docstring).

        Raises:
            NoKernelFoundError: no graph-safe kernel for an op inside a piece (the caller runs such steps
                eagerly and says why).
        """
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        try:
            for size in reversed(self.sizes):
                batch = self._dummy(size)
                if cuda:
                    side.wait_stream(torch.cuda.current_stream(self.device))
                with lz.capture_selection(), torch.cuda.stream(side) if cuda else nullcontext():
                    self._mode = "warm"
                    for _ in range(2):
                        self._layer = 0
                        self.model(batch, self.kv_caches)
                    if cuda:
                        torch.cuda.current_stream(self.device).wait_stream(side)
                        torch.cuda.synchronize(self.device)
                    self._mode, self._layer, self._piece = "capture", 0, []
                    self._begin()
                    logits = self.model(batch, self.kv_caches)
                    self._end()
                if self._layer != len(self.attention):
                    raise RuntimeError(
                        f"piecewise capture: {self._layer} attention calls in the captured forward, "
                        f"{len(self.attention)} in its warm-up; a model's forward must call every layer's "
                        "attention once, in order"
                    )
                self.graphs[size], self.logits[size] = self._piece, logits
                self.static[3].zero_()  # the dummy step's attention output: no stale NaN in padded rows
        except BaseException:
            if self._capturing:
                with suppress(Exception):  # the error that stopped the capture is the one to raise
                    self._end()
            self.graphs.clear()
            raise
        finally:
            self._mode, self._eager, self._piece = None, None, []
        if cuda:
            torch.cuda.synchronize(self.device)
        log.info("piecewise CUDA graphs captured for steps of up to %s tokens", self.sizes)

    def _dummy(self, size: int) -> ForwardBatch:
        """The capture's batch for bucket ``size``: the static ids, positions and rows, ``pieces`` this
        object; its attention calls read one sequence of ``size`` tokens over block 0 that writes no KV
        (slots -1)."""
        n = -(-size // self.block_size)
        eager = build_forward_batch(
            [ScheduledChunk([0] * size, 0, size, [0] * n, True)], self.block_size, self.device
        )
        eager.slot_mapping.fill_(-1)
        self._eager = eager
        self.positions[:size].zero_()  # any valid position (a bucket may exceed max_model_len)
        rows = self.rows[: self.rows_cap[size]]
        return replace(
            eager,
            input_ids=self.ids[:size],
            positions=self.positions[:size],
            logits_indices=rows,
            pieces=self,
        )
