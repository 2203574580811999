"""``ModelRunner``: the model, its per-layer KV block pools, and one forward per step."""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import numpy as np
import torch

import layerzero as lz

from ..config import KV_CACHE_DTYPES, CudaGraphKnobs, EngineConfig, ModelConfig
from ..core.sched.output import SchedulerOutput
from ..errors import bad_config
from ..layers.attention import KVScales
from ..layers.quantized_linear import quantize_model
from ..loader import load_dummy_weights, load_model_weights
from ..models.registry import build_model
from ..parallel.launch import all_reduce_min
from ..parallel.state import SINGLE, ParallelState
from .cascade import CascadePolicy
from .cuda_graph import CUDAGraphRunner
from .input_batch import ForwardBatch, ScheduledChunk, build_forward_batch, build_packed_decode_batch
from .piecewise import PiecewiseGraphs, piecewise_sizes, piecewise_tokens
from .prompt_logprobs import prompt_rows
from .sampler import PendingSample
from .staging import to_device

__all__ = ["ModelRunner", "StepLogits", "kv_bytes_per_block"]

log = logging.getLogger("layerzero.engine")
ACTIVATION_RESERVE_BYTES_PER_TOKEN = 64 * 1024
"""CUDA pool sizing leaves this much per batched token for activations and logits (a bound for the supported
model sizes; the pool is ``free memory x kv_cache_memory_fraction`` minus this reserve)."""


class StepLogits(NamedTuple):
    """A step's forward result: ``logits`` ``[S, V]`` (model dtype) of its sampled rows and, when a greedy
    decode graph also sampled them, ``pending``: their ids (``lz.sample_greedy`` of those logits) on their way
    to the host, as :meth:`~layerzero.engine.sampler.Sampler.launch` would return them; else None (the sampler
    draws). ``prompt_hidden`` ``[R, H]``: the final hidden states of the prompt positions whose logprobs the
    step computes (``SchedulerOutput.prompt_logprobs``; their logits are computed a slice at a time:
    :func:`~.prompt_logprobs.launch_prompt_logprobs`), else None."""

    logits: torch.Tensor
    pending: PendingSample | None
    prompt_hidden: torch.Tensor | None = None


def kv_bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    """Bytes one block takes over all layers: layers x 2 (K, V) x block_size x Hkv x D x itemsize (``Hkv``:
    ``num_kv_heads``, this rank's under tensor parallelism; None: the config's)."""
    hkv = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    return cfg.num_layers * 2 * block_size * hkv * cfg.head_dim * dtype.itemsize


class ModelRunner:
    """Loads the model on ``device`` in ``dtype``, sizes and allocates the KV pools (in ``kv_dtype``: the
    model's dtype, or float8_e4m3fn / int8 for ``kv_cache_dtype="fp8" | "int8"``), runs steps.

    ``parallel``: this rank's place among the tensor-parallel ranks (:class:`ParallelState`), passed to
    ``build_model``; with several ranks the KV block count is the minimum over them (a collective: every rank
    builds its runner at the same time). ``EngineConfig.load_format="dummy"``: seeded random weights
    (``seed + tp_rank``) instead of the checkpoint's. ``extra_kv_bytes_per_block``: bytes per block of
    another pool addressed by the same block ids (a speculative draft model's), counted when the block count
    is sized from memory."""

    def __init__(
        self,
        cfg: ModelConfig,
        ec: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_batched_tokens: int,
        parallel: ParallelState = SINGLE,
        extra_kv_bytes_per_block: int = 0,
    ) -> None:
        self.cfg, self.device, self.dtype, self.block_size = cfg, device, dtype, ec.block_size
        self.extra_kv_bytes_per_block = extra_kv_bytes_per_block
        self.max_model_len = max_model_len
        self.parallel = parallel
        self.kv_dtype = KV_CACHE_DTYPES[ec.kv_cache_dtype] or dtype
        self.model = build_model(cfg, max_model_len, device, dtype, parallel)
        t0 = time.perf_counter()
        if ec.load_format == "dummy":  # config.json was read; no weight file is
            load_dummy_weights(self.model, ec.seed)  # shards differ per rank, replicated weights agree
        else:
            load_model_weights(self.model, ec.model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        #: This rank's weight bytes and the seconds loading them took (EngineStats.weights_*).
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.weights_load_s = time.perf_counter() - t0
        log.info(
            "weights (%s, rank %d): %.2f GB in %.2f s = %.2f GB/s",
            ec.load_format,
            parallel.tp_rank,
            self.weights_bytes / 1e9,
            self.weights_load_s,
            self.weights_bytes / 1e9 / max(self.weights_load_s, 1e-9),
        )
        self.quantization = None
        if ec.quantization is not None:
            self.quantization = quantize_model(self.model, ec.quantization)
            log.info(
                "quantization %s: %d linears, %.1f -> %.1f MiB",
                ec.quantization,
                self.quantization.layers,
                self.quantization.float_bytes / 2**20,
                self.quantization.quantized_bytes / 2**20,
            )
        self.num_kv_heads: int = getattr(self.model, "num_local_kv_heads", cfg.num_kv_heads)
        """KV heads per layer in this rank's pool (the model's: a tensor-parallel rank's share)."""
        self.num_blocks = self._num_blocks(ec, max_model_len, max_num_batched_tokens)
        if parallel.is_parallel:  # the least any rank can hold: no rank over-commits its memory
            self.num_blocks = all_reduce_min(self.num_blocks, parallel, device)
        if self.num_blocks * ec.block_size < max_model_len:
            raise bad_config(
                "KV cache size",
                f">= max_model_len ({max_model_len}) tokens for one sequence",
                f"{self.num_blocks} blocks x {ec.block_size} tokens",
                "Raise num_kv_blocks (or the memory fraction) or lower max_model_len.",
            )
        self.kv_caches = [
            lz.allocate_kv_cache(
                self.num_blocks, ec.block_size, self.num_kv_heads, cfg.head_dim, self.kv_dtype, "NHD", device
            )
            for _ in range(cfg.num_layers)
        ]
        log.info(
            "KV cache: %d blocks of %d tokens, %s (%.1f MiB)",
            self.num_blocks,
            ec.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            self.num_blocks
            * kv_bytes_per_block(cfg, ec.block_size, self.kv_dtype, self.num_kv_heads)
            / 2**20,
        )
        self.cascade = self._cascade_policy(ec)
        self.cascade_steps = 0
        self.cascade_saved_tokens = 0
        """Cascade steps run (decode and mixed) and the KV tokens (per layer) their shared level did not read
        again."""
        self.graphs: CUDAGraphRunner | None = None
        self.narrow: CUDAGraphRunner | None = None
        """Batch-1 decode graphs with narrower block tables (``CudaGraphKnobs.narrow_tokens``), or None."""
        self.last_batch: ForwardBatch | None = None
        self.verify_as_decode: bool | None = None
        """Speculative verification steps as decode steps of one row per verified position
        (:meth:`_verify_as_decode`): None = when the decode CUDA graphs hold them; True / False = always (when
        the step has no prefill chunk) / never."""
        self._lane = 0
        """The packed-input lane the next packed decode step takes (``CudaGraphKnobs.lanes``)."""
        self.decode_as_captured = False
        """Eager decode steps select under ``lz.capture_selection()`` (the kernels the decode graphs run), so
        graphs and eager (``enforce_eager``, batches beyond the largest graph) give the same tokens; off when
        no graph-safe kernel can run a decode step here (e.g. a quantized KV pool): decode then runs eager
        kernels."""
        if device.type == "cuda":
            spec = ec.speculative_config
            # a verification step replays the decode graphs as one row per verified position
            # (_verify_as_decode): with speculation the buckets reach max_num_seqs x (1 + k) rows (at
            # most 512)
            rows = (
                ec.max_num_seqs
                if spec is None
                else min(ec.max_num_seqs * (1 + spec.num_speculative_tokens), 512)
            )
            graphs = CUDAGraphRunner(
                self.model,
                self.kv_caches,
                max(rows, ec.max_num_seqs),
                -(-max_model_len // ec.block_size),
                device,
                cascade=self.cascade is not None,
                knobs=ec.cuda_graph,
            )
            try:
                if ec.enforce_eager:
                    graphs.warm_as_captured()
                else:
                    graphs.capture()
                    narrow = self._narrow_graphs(
                        max_model_len, ec.block_size, device, ec.cuda_graph
                    )  # both or neither
                    self.graphs, self.narrow = graphs, narrow
                self.decode_as_captured = True
            except lz.LayerZeroError as exc:  # e.g. no graph-safe kernel for an op here: decode runs eager
                if lz.get_config().strict and not ec.enforce_eager:
                    raise
                log.warning(
                    "%s (decode runs eager kernels): no graph-safe kernel for a decode step: %s",
                    "eager decode" if ec.enforce_eager else "CUDA graphs off",
                    exc,
                )
        self.pieces: PiecewiseGraphs | None = None
        """Piecewise graphs of steps with prefill tokens (``CudaGraphKnobs.piecewise_max_tokens``) or None."""
        if device.type == "cuda" and not ec.enforce_eager and (tokens := piecewise_tokens(ec)):
            self.pieces = self._piecewise(ec, tokens, max_num_batched_tokens)
        if self.kv_dtype == torch.int8:  # after capture, so the capture's dummy batch calibrates nothing
            for m in self.model.modules():
                if isinstance(m, KVScales):
                    m.calibrate = True

    def _piecewise(
        self, ec: EngineConfig, tokens: int, max_num_batched_tokens: int
    ) -> PiecewiseGraphs | None:
        """The captured piecewise graphs, or None (logged; raised in strict mode) when a piece has no
        graph-safe kernel here, or, with the knob on auto (None), when the capture fails for any reason."""
        spec = ec.speculative_config
        rows = ec.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        sizes = piecewise_sizes(tokens, max_num_batched_tokens)
        pieces = PiecewiseGraphs(self.model, self.kv_caches, sizes, rows, ec.block_size, self.device)
        try:
            pieces.capture()
        except Exception as exc:  # auto (knob None) never stops the engine; a value the user set may
            explicit = ec.cuda_graph.piecewise_max_tokens is not None
            if lz.get_config().strict or (explicit and not isinstance(exc, lz.LayerZeroError)):
                raise
            log.warning(
                "piecewise CUDA graphs off (steps with prefill tokens run eager): %s: %s",
                type(exc).__name__,
                exc,
            )
            return None
        return pieces

    def _cascade_policy(self, ec: EngineConfig) -> CascadePolicy | None:
        """``cascade_attention=True`` -> every step (decode, or with prefill chunks) with a shared prefix
        (``CascadePolicy(always=True)``); False -> off; None (the default) -> on CUDA with prefix caching and
        an unquantized KV pool, steps whose shared prefixes save enough reads (``CascadePolicy()``'s
        thresholds: a step sharing nothing keeps its plain decode graph), else off. Why the default: the
        shared-prefix benchmark gains from it and a workload sharing nothing does not lose
        (benchmarks/results/history.md).

        Raises:
            ConfigurationError: ``cascade_attention=True`` with a quantized KV pool."""
        if ec.cascade_attention is False:
            return None
        if ec.cascade_attention is None:
            if self.device.type != "cuda" or not ec.enable_prefix_caching or self.kv_dtype != self.dtype:
                return None
            return CascadePolicy()
        if self.kv_dtype != self.dtype:
            raise bad_config(
                "LLM cascade_attention",
                f"False or None with kv_cache_dtype {ec.kv_cache_dtype!r}",
                True,
                "Cascade attention reads an unquantized KV pool "
                "(the engine's cascade steps do not pass a quantized pool's scales yet).",
            )
        return CascadePolicy(always=True)

    def _num_blocks(self, ec: EngineConfig, max_model_len: int, max_num_batched_tokens: int) -> int:
        if ec.num_kv_blocks is not None:
            return ec.num_kv_blocks
        per_block = kv_bytes_per_block(self.cfg, ec.block_size, self.kv_dtype, self.num_kv_heads)
        per_block += self.extra_kv_bytes_per_block  # a draft model's pool, addressed by the same blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = (
                free * ec.kv_cache_memory_fraction
                - ACTIVATION_RESERVE_BYTES_PER_TOKEN * max_num_batched_tokens
            )
        else:
            budget = ec.cpu_kv_cache_bytes
        need = ec.max_num_seqs * -(-max_model_len // ec.block_size) + 1
        return max(0, min(int(budget // per_block), need))

    # no_grad, not inference_mode: the step's metadata tensors keep their version counters, which FlashInfer's
    # plan cache needs to reuse one plan for every layer of a step (inference tensors re-plan per call)
    @torch.no_grad()
    def execute(
        self,
        out: SchedulerOutput,
        prev_tokens: torch.Tensor | None = None,
        greedy: bool = False,
        spec_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> StepLogits:
        """Forward the step ``out`` (plain data: chunks, block tables); returns logits ``[S, V]`` (model
        dtype) of the chunks that sample (``out.sample``, in chunk order), with their greedy ids in transfer
        to the host (``pending``) when ``greedy`` (the step is plain greedy: ``sampler.plain_greedy``) and a
        greedy decode graph ran it (else ``pending`` is None and the sampler draws). ``prev_tokens``
        ``[S_prev]`` int64 on the device: the previous step's sampled tokens, for chunks whose last token is
        pending (``out.pending_src``; async scheduling). ``spec_inputs`` (rows ``[D]`` int64, ids ``[D]``
        int64, on the device): input ids written into the batch before the forward (a draft model's drafts); a
        verification step (``out.spec_token_ids``) has ``1 + drafts`` logits rows per sampled chunk (eager:
        its chunks are not one token). The step's :class:`ForwardBatch` stays in ``last_batch`` (the draft
        model's KV mirror reads it)."""
        batch = self.prepare(out, prev_tokens)
        if spec_inputs is not None:  # a draft model's drafts, proposed on the device
            batch.input_ids.index_copy_(0, *spec_inputs)
        self.last_batch = batch
        if batch.cascade is not None:
            self.cascade_steps += 1
            self.cascade_saved_tokens += batch.cascade.saved_tokens
        if out.prompt_logprobs:  # prompt rows are prefill rows: eager, never a decode graph
            return self._with_prompt_rows(batch, out)
        graphs = self.graphs_for(batch)
        if graphs is not None:
            done = graphs.run_greedy(batch) if greedy else None
            if done is not None:
                logits, tokens, host, event = done
                return StepLogits(logits, PendingSample(tokens, [host], event, [], []))
            return StepLogits(graphs.run(batch), None)
        if self.pieces is not None and self.pieces.can_run(batch):
            return StepLogits(self.pieces.run(batch), None)
        return StepLogits(self._eager(batch), None)

    @torch.no_grad()
    def copy_blocks(self, pairs: list[tuple[int, int]], extra_caches: tuple | list = ()) -> None:
        """Copy whole KV blocks ``src -> dst`` for each ``(src, dst)`` of ``pairs`` (block ids; the dst blocks
        distinct and none of them a src) in every layer's pool, K and V (``kv_caches`` and ``extra_caches``,
        e.g. a draft model's; each ``[num_blocks, 2, block_size, Hkv, D]``): the copy-on-write half of a fork
        (``SchedulerOutput.blocks_to_copy``; vLLM's ``copy_blocks``). Byte copies, so any KV dtype (fp8 /
        int8 pools too: their scales are per layer, not per block, and need no copy); queued on the current
        stream, before the step's forward."""
        (sd,) = to_device([np.asarray(pairs, dtype=np.int64).reshape(-1, 2)], self.device)
        src, dst = sd[:, 0], sd[:, 1]
        for cache in (*self.kv_caches, *extra_caches):
            c = cache.view(torch.uint8) if cache.element_size() == 1 else cache
            c.index_copy_(0, dst, c.index_select(0, src))

    def kernel_report(self, buckets: list[tuple[str, int]]) -> dict[str, Any]:
        """For each ``(kind, tokens)`` bucket (``"decode"``: that many sequences of one token; ``"prefill"``:
        one chunk of that many tokens, at most ``max_model_len``), the model's forward as ``lz.dry_run``
        records it (every op call selected and recorded, no kernel run, the KV pools untouched; decode as the
        CUDA graphs select it, ``lz.capture_selection``; a prefill that piecewise graphs hold as their replay
        selects it, :meth:`PiecewiseGraphs.forward_as_replayed`): ``{op: {"decode/1": [{"shapes", "kernel",
        "why", "bucket"}, ...]}}`` with each distinct call once. Plain data."""
        report: dict[str, dict[str, list[dict[str, Any]]]] = {}
        bs = self.block_size
        for kind, n in buckets:
            if kind == "decode":
                chunks = [ScheduledChunk([0], 0, 1, [0], True) for _ in range(n)]
            else:
                n = min(n, self.max_model_len)
                chunks = [ScheduledChunk([0] * n, 0, n, list(range(-(-n // bs))), True)]
            batch = build_forward_batch(chunks, bs, self.device)

            def forward(batch: ForwardBatch = batch, decode: bool = kind == "decode") -> Any:
                if decode and self.decode_as_captured:
                    with lz.capture_selection():
                        return self.model(batch, self.kv_caches)
                if not decode and self.pieces is not None and self.pieces.can_run(batch):
                    return self.pieces.forward_as_replayed(batch)  # as its piecewise graphs select
                return self.model(batch, self.kv_caches)

            rows = lz.dry_run(forward).rows
            seen = set()
            for r in rows:
                if (r.op, r.shapes) in seen:
                    continue
                seen.add((r.op, r.shapes))
                report.setdefault(r.op, {}).setdefault(f"{kind}/{n}", []).append(
                    {"shapes": r.shapes, "kernel": r.kernel, "why": r.why, "bucket": r.bucket}
                )
        return report

    def _narrow_graphs(
        self, max_model_len: int, block_size: int, device: torch.device, knobs: CudaGraphKnobs
    ) -> CUDAGraphRunner | None:
        """Batch-1 decode graphs whose block tables are ``knobs.narrow_tokens`` wide (rounded down to whole
        blocks), captured when the main graphs' tables are wider; None otherwise."""
        narrow = knobs.narrow_tokens
        if narrow is None or narrow < block_size or -(-max_model_len // block_size) * block_size <= narrow:
            return None
        graphs = CUDAGraphRunner(self.model, self.kv_caches, 1, narrow // block_size, device, knobs=knobs)
        graphs.capture()
        return graphs

    def graphs_for(self, batch: ForwardBatch) -> CUDAGraphRunner | None:
        """The decode graphs that replay ``batch``: the narrow batch-1 ones when it fits them (one sequence,
        its table no wider than theirs, no cascade step), else the main ones when they can; None: the step
        runs eager. A packed batch goes back to the graphs whose buffer it was packed into (only theirs have
        its width)."""
        for graphs in (self.narrow, self.graphs):
            if graphs is not None and graphs.can_run(batch):
                return graphs
        return None

    def _eager(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits from an eager forward."""
        if batch.is_decode and self.decode_as_captured:
            # the kernels a decode graph runs (graph-safe, scored for in-graph time), so eager decode
            # (enforce_eager, batches beyond the largest graph) computes what the graphs compute: the same
            # tokens either way
            with lz.capture_selection():
                return self.model(batch, self.kv_caches)
        return self.model(batch, self.kv_caches)

    def _with_prompt_rows(self, batch: ForwardBatch, out: SchedulerOutput) -> StepLogits:
        """An eager forward of a step with prompt-logprob rows: the sampled rows' logits and the prompt rows'
        final hidden states (one gather of both, ``prompt_rows`` order)."""
        rows = prompt_rows(out.num_scheduled_tokens, out.sample, out.prompt_logprobs)
        (idx,) = to_device([rows], self.device)
        if batch.is_decode and self.decode_as_captured:  # as _eager: one-token chunks select as captured
            with lz.capture_selection():
                h = self.model.hidden_states(batch, self.kv_caches)
        else:
            h = self.model.hidden_states(batch, self.kv_caches)
        s = len(out.sampling)  # the sampled rows come first in ``rows``; a verification step has more
        return StepLogits(self.model.compute_logits(h[batch.logits_indices]), None, h[idx[s:]])

    def prepare(self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None) -> ForwardBatch:
        """The step's :class:`ForwardBatch` (a pending last token's id gathered from ``prev_tokens``); the
        chunks' tables come from ``out.block_tables``, so their ``block_table`` is left empty."""
        block_tables = out.block_tables
        spec = out.spec_token_ids or [()] * len(out.sample)
        sched = [
            ScheduledChunk(ids, start, n, (), last, src, start, len(d))
            for ids, start, n, last, src, d in zip(
                out.new_token_ids,
                out.num_computed_tokens,
                out.num_scheduled_tokens,
                out.sample,
                out.pending_src,
                spec,
                strict=True,
            )
        ]
        cascade = self.cascade
        if any(spec) and self._verify_as_decode(sched):
            sched, block_tables = _decode_rows(sched, block_tables)
            cascade = None  # rows of one sequence at successive positions: no shared-prefix planning
        if all(c.length == 1 and c.sample for c in sched):
            for graphs in (
                self.narrow,
                self.graphs,
            ):  # the narrow batch-1 graphs first, as graphs_for picks them
                target = (
                    graphs.pack_for(len(sched), block_tables.shape[1], self._lane)
                    if graphs is not None
                    else None
                )
                if (
                    target is not None
                ):  # a packed decode bucket: the inputs go straight into a lane of its buffers
                    self._lane = (self._lane + 1) % graphs.knobs.lanes  # alternate steps take alternate lanes
                    return build_packed_decode_batch(
                        sched, self.block_size, block_tables, prev_tokens, target, cascade
                    )
        return build_forward_batch(sched, self.block_size, self.device, prev_tokens, cascade, block_tables)

    def _verify_as_decode(self, sched: list[ScheduledChunk]) -> bool:
        """Whether a verification step runs as a decode step of one row per verified position
        (:func:`_decode_rows`): ``verify_as_decode`` True, or None (the default) and the rows fit the decode
        CUDA graphs (every other chunk one sampled token, at most the largest bucket's rows). Then it replays
        a graph instead of running eager."""
        if self.verify_as_decode is not None:
            return self.verify_as_decode and all(c.num_spec or (c.length == 1 and c.sample) for c in sched)
        g = self.graphs
        if g is None or not all(c.num_spec or (c.length == 1 and c.sample) for c in sched):
            return False
        return sum(c.length for c in sched) <= g.sizes[-1]


def _decode_rows(sched: list[ScheduledChunk], tables: np.ndarray) -> tuple[list[ScheduledChunk], np.ndarray]:
    """A verification step as one-token rows: a chunk of the last token and d drafts at positions P .. P + d
    becomes d + 1 rows at P + j, each attending to its sequence's KV up to P + j. Every layer writes all rows'
    KV before it attends (the KV write precedes the attention in both the eager and the graphed paths; not in
    the opt-in fused ``triton.rope_paged_decode`` kernel, which writes each row's KV inside its attention
    kernel), so row j sees positions P .. P + j - 1 of this step: the same causal attention as the chunk, and
    the logits come out in the chunk's order (``1 + d`` rows per speculating chunk). Returns the rows and
    their block tables (a chunk's row repeated)."""
    rows: list[ScheduledChunk] = []
    reps = []
    for c in sched:
        n = c.length
        reps.append(n)
        if not c.num_spec:
            rows.append(c)
            continue
        base = c.start - c.offset
        for j in range(n):
            rows.append(
                ScheduledChunk(
                    c.token_ids[base + j : base + j + 1], c.start + j, 1, (), True, None, c.start + j
                )
            )
    return rows, np.repeat(tables, reps, axis=0)
