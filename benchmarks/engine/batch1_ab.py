"""Batch-1 decode A/B of engine variants in one process (CUDA), and where a step's time goes on the GPU
timeline.

Each variant is a setting applied before the ``LLM`` (and so its CUDA graphs) is built; variants alternate (A
B A B ...) to spread machine drift. Per run: the whole step (``generate`` of one greedy request, 256-token
prompt, ``--tokens`` new), the decode graph's replay alone (back to back), and the host time of the step's
calls that may block (``CUDAGraph.replay``, the sampler's event wait). Then, for the first variant, a
torch.profiler trace of one generate: GPU busy vs idle per step, the largest idle gaps and what ran around
them, and the CUDA runtime calls by host time (``timeline.md``).

Variants (``--variants``, comma-separated): ``prefetch`` / ``rows`` (``GemvKnobs.prefetch`` on / off),
``pdl-off`` (``LAYERZERO_TRITON_PDL`` off: ``triton.launch``'s knob ``pdl=False``), ``unfused`` (each norm and
the projection after it as two calls instead of ``lz.rms_norm_linear``, the activation and down projection
instead of ``lz.swiglu_linear``), ``unfused-norm`` (the norms only), ``fused-merge`` (``triton.paged_decode``
merges its splits in the split kernel in graphs too), ``splits-8`` / ``splits-4`` (at most that many KV splits
per sequence), ``attn-unfused`` (the attention block as the four kernels it was before
``lz.rope_paged_attention``), ``gemv-16k-8w`` / ``gemv-8w`` / ``gemv-2w`` (``triton.gemv``'s prefetch kernel
with slabs of 16384 elements and 8 warps, 8 warps, 2 warps; likewise the other ``gemv-*``), ``qkv-16k-8w`` /
``o-4w`` / ... (one Qwen3-0.6B projection's prefetch config: ``GemvKnobs.prefetch_by_shape``), ``l2-prefetch``
(the o and gate/up weights prefetched into L2 during the attention block: ``l2_prefetch.py``, an experiment),
``l2-side-o`` / ``l2-side-o-gu`` (the o weight, and gate/up, prefetched from a parallel branch of the graph
that joins at the end of the forward: ``l2_prefetch.SideBranch``; slower, 2026-11-28g), ``packed`` (small
decode buckets read their inputs from one buffer the step's single host-to-device copy writes:
``CudaGraphKnobs.packed_inputs``), ``splits-1`` / ``splits-2`` (at most 1 / 2 KV splits: one split needs no
merge kernel), ``unpacked`` (``packed_inputs`` off), ``rope-paged-fused`` (``lz.rope_paged_attention`` locked
to ``triton.rope_paged_decode``: q/k norm, RoPE and the KV write in the split kernel), ``tile-32-s8`` /
``tile-64-s16`` / ... (``triton.paged_decode``'s batch-1 tiles of 32 / 64 positions, at most 8 / 16 splits:
``PagedDecodeKnobs.small_batch``; ``tile-32-s16-8w`` with 8 warps a split program), ``tiles-old``
(``small_batch`` off: 128-position tiles and the general split rule, as before 2026-11-28d), ``narrow-graphs``
(batch-1 decode graphs with 2048-token tables beside the ``max_model_len``-wide ones:
``CudaGraphKnobs.narrow_tokens``; with ``--max-model-len`` above 2048), ``lm-prefetch`` / ``lm-prefetch-8w``
(the LM head on ``triton.gemv``'s prefetch kernel: ``GemvKnobs.prefetch_wide``), ``argmax-old`` (every greedy
step through the float32 cast and the general path, as before ``lz.sample_greedy``), ``greedy-graph-off``
(``CudaGraphKnobs.greedy_in_graph`` off: greedy steps sampled after a plain graph), ``h2d-inline`` /
``d2h-inline`` / ``copies-inline`` (a chained step's input copy / greedy ids' transfer / both on the current
stream), ``2026-11-27`` (the launch configs of that day: prefetch kernel 4 warps everywhere, 16 RoPE heads a
program), ``split-2w`` / ``split-8w`` / ``merge-1w`` / ``merge-2w`` (warps of ``triton.paged_decode``'s two
kernels), ``one-pass`` / ``no-one-pass`` (``PagedDecodeKnobs.one_pass`` on / off: a batch-1 split's tiles
gathered at once, block ids read without waiting for ``seq_len``; ``-8w`` with 8 warps a split program,
``-s32`` with 32 splits of at most 2 tiles), ``early-on`` / ``early-off`` (``PagedDecodeKnobs.early_kv``, off
by default: the split kernel's K / V but the newest position read before its PDL wait, or after it),
``trigger-off`` / ``trigger-merge`` / ``trigger-gemv`` / ``trigger-both`` (``PagedDecodeKnobs.trigger_first``
and ``GemvKnobs.trigger_first_rows``, on by default: the split merge and the one-row projections let the next
kernel launch before their own wait; off, the merge only, the projections only, the split kernel too; the
per-projection forms measured on 2026-11-28 are in that day's results), ``rope-fused-1p`` /
``rope-fused-1p-s32`` (``rope-paged-fused`` with ``one_pass``, and 32 splits), ``tiles-28d`` (the batch-1 rule
of 2026-11-28d: 16 splits, the tile loop), ``rope-bh1`` ... ``rope-bh16`` (query / key heads per program of
the RoPE kernels at most: ``RopeKnobs.block_h_max``), ``base`` (nothing changed).

Usage: ``PYTHONPATH=src:benchmarks python benchmarks/engine/batch1_ab.py --out DIR`` (CUDA). Writes
``DIR/batch1_ab.md`` and ``DIR/timeline.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import itertools
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from gpu_timeline import profile_events, summarize  # benchmarks/engine on sys.path

import layerzero as lz
from layerzero.backends.triton import _launch, paged, rope, rope_paged
from layerzero.backends.triton import gemv as tg
from layerzero.core.knobs import knobs
from layerzero.engine import LLM, SamplingParams
from layerzero.engine.config import CudaGraphKnobs
from layerzero.engine.core.kv.block_manager import KVCacheManager
from layerzero.engine.core.llm_engine import EngineLoop
from layerzero.engine.core.sched.scheduler import Scheduler
from layerzero.engine.models import llama
from layerzero.engine.tools.bench import default_checkpoint
from layerzero.engine.worker import input_batch as forward_batch
from layerzero.engine.worker import model_runner
from layerzero.engine.worker import sampler as sampler_mod
from layerzero.engine.worker.cuda_graph import CUDAGraphRunner
from layerzero.engine.worker.model_runner import ModelRunner
from layerzero.engine.worker.sampler import Sampler

HOST_FUNCS = [
    (model_runner, "build_forward_batch"),
    (forward_batch, "to_device"),
    (CUDAGraphRunner, "run"),
    (Scheduler, "schedule"),
    (Scheduler, "after_forward"),
    (KVCacheManager, "block_tables"),
    (EngineLoop, "_read"),
    (EngineLoop, "_finish_step"),
    (Sampler, "resolve"),
]
"""Host functions of a decode step whose time :class:`HostTimer` records (median and mean per call)."""
PROMPT = [7 + (i * 37) % 9000 for i in range(256)]
MAX_MODEL_LEN = 2048
"""The engine's ``max_model_len`` (its decode graphs' block-table width); ``--max-model-len``."""


def _two_calls(norm, proj, x, residual):
    """The engine's norm -> projection as two calls (before ``lz.rms_norm_linear``): the ``unfused``
    variant."""
    if residual is None:
        return proj(norm(x)), x
    h, residual = norm(x, residual)
    return proj(h), residual


_ATTEND = llama.Attention.attend


def _attend_unfused(self, qkv, batch, kv_cache):
    """The attention block as four kernels (before ``lz.rope_paged_attention``) in captured steps too: the
    engine's eager-step calls (``lz.qk_norm_rope`` or ``lz.rope``, ``lz.reshape_and_cache``,
    ``lz.paged_attention``): the ``attn-unfused`` variant."""
    return _ATTEND(self, qkv, dataclasses.replace(batch, graphed=False), kv_cache)


_LAYER_FORWARD = llama.DecoderLayer.forward
_L2_GATE_UP: list[torch.Tensor | None] = [None]
"""The gate/up weight of the decoder layer running now (``l2-prefetch``: set by the layer, read by its
attention)."""


def _layer_l2_prefetch(self, x, residual, batch, kv_cache):
    """``llama.DecoderLayer.forward`` that first tells its attention which gate/up weight comes after it (the
    ``l2-prefetch`` variant, with :func:`_attend_l2_prefetch`)."""
    _L2_GATE_UP[0] = self.mlp.gate_up_proj.weight if isinstance(self.mlp, llama.MLP) else None
    return _LAYER_FORWARD(self, x, residual, batch, kv_cache)


def _attend_l2_prefetch(self, qkv, batch, kv_cache):
    """``llama.Attention.attend`` preceded, in captured decode steps of at most 4 sequences, by the L2
    prefetch of the o and gate/up weights (``l2_prefetch.py``): right after the QKV projection, during the
    attention block."""
    from l2_prefetch import prefetch_l2

    gate_up = _L2_GATE_UP[0]
    if batch.graphed and batch.num_seqs <= 4 and gate_up is not None:
        prefetch_l2(self.o_proj.weight, gate_up)
    return _ATTEND(self, qkv, batch, kv_cache)


_SIDE: list = [None]  # the l2-side-* variants' SideBranch (made on first use: l2_prefetch imports triton)


class _FLAGS:  # noqa: N801  (a settings target, as a module is)
    side_gate_up = False
    """``l2-side-o-gu``: the side branch prefetches the gate/up weight too."""


_MODEL_FORWARD = llama.LlamaForCausalLM.forward


def _side_branch():
    if _SIDE[0] is None:
        from l2_prefetch import SideBranch

        _SIDE[0] = SideBranch()
    return _SIDE[0]


def _attend_l2_side(self, qkv, batch, kv_cache):
    """``llama.Attention.attend`` that, in captured decode steps of at most 4 sequences, first forks a side
    branch prefetching the o weight (and gate/up with ``l2-side-o-gu``) into L2 while the attention kernels
    run."""
    gate_up = _L2_GATE_UP[0]
    if batch.graphed and batch.num_seqs <= 4 and torch.cuda.is_current_stream_capturing():
        if _FLAGS.side_gate_up and gate_up is not None:
            _side_branch().fork(self.o_proj.weight, gate_up)
        else:
            _side_branch().fork(self.o_proj.weight)
    return _ATTEND(self, qkv, batch, kv_cache)


def _model_forward_joined(self, batch, kv_caches):
    """``LlamaForCausalLM.forward`` joining the side branch's prefetches at its end (the l2-side-*
    variants)."""
    logits = _MODEL_FORWARD(self, batch, kv_caches)
    if _SIDE[0] is not None:
        _SIDE[0].join()
    return logits


class _TorchArgmax:
    """``layerzero`` for the sampler module, but ``sample_greedy`` is ``torch.argmax`` (the ``argmax-old``
    variant)."""

    def __getattr__(self, name):
        return getattr(lz, name)

    @staticmethod
    def sample_greedy(logits):
        return logits.argmax(dim=-1)


LOCK = object()
"""A setting ``(LOCK, op, kernel_id)``: ``lz.lock(op, kernel_id)`` for the variant, ``lz.unlock(op)``
after."""
GRAPH = object()
"""A setting ``(GRAPH, field, value)``: the variant's engine gets ``LLM(cuda_graph=CudaGraphKnobs(field=value,
...))``."""
PAGED, GEMV, ROPE = paged.KNOBS, tg.KNOBS, rope.KNOBS
"""A setting ``(PAGED, field, value)``: ``triton.paged_decode``'s knob ``field`` is ``value`` for the variant
(the same for ``triton.gemv``'s and ``triton.rope``'s); any other ``(owner, attr, value)`` sets an attribute
and puts it back after."""


def _mlp_two_calls(self, gate_up):
    """The MLP's activation and down projection as two calls (before ``lz.swiglu_linear``)."""
    return self.down_proj(llama.silu_and_mul(gate_up))


SETTINGS = {
    "prefetch": [(GEMV, "prefetch", True)],
    "rows": [(GEMV, "prefetch", False)],
    "pdl-off": [(_launch.KNOBS, "pdl", False)],
    "unfused": [(llama, "norm_linear", _two_calls), (llama.MLP, "down", _mlp_two_calls)],
    "unfused-norm": [(llama, "norm_linear", _two_calls)],
    "fused-merge": [(PAGED, "fused_merge_in_graphs", True)],
    "splits-8": [(PAGED, "max_splits", 8)],
    "splits-4": [(PAGED, "max_splits", 4)],
    "base": [],
    "attn-unfused": [(llama.Attention, "attend", _attend_unfused)],
    "gemv-16k-8w": [(GEMV, "prefetch_slab", 16384), (GEMV, "prefetch_warps", 8)],
    "gemv-8w": [(GEMV, "prefetch_warps", 8)],
    "gemv-2w": [(GEMV, "prefetch_warps", 2)],
    "gemv-4k-1w": [(GEMV, "prefetch_slab", 4096), (GEMV, "prefetch_warps", 1)],
    "gemv-8k-1w": [(GEMV, "prefetch_warps", 1)],
    "gemv-4k-2w": [(GEMV, "prefetch_slab", 4096), (GEMV, "prefetch_warps", 2)],
    "gemv-16k-2w": [(GEMV, "prefetch_slab", 16384), (GEMV, "prefetch_warps", 2)],
    "gemv-4w": [(GEMV, "prefetch_warps", 4)],
    "packed": [(GRAPH, "packed_inputs", True)],
    "unpacked": [(GRAPH, "packed_inputs", False)],
    "greedy-graph-off": [(GRAPH, "greedy_in_graph", False)],
    "h2d-inline": [(GRAPH, "h2d_aside", False)],
    "d2h-inline": [(GRAPH, "d2h_aside", False)],
    "copies-inline": [(GRAPH, "h2d_aside", False), (GRAPH, "d2h_aside", False)],
    "rope-paged-fused": [(LOCK, "rope_paged_attention", "triton.rope_paged_decode")],
    **{
        f"tile-{bn}-s{sp}": [(PAGED, "small_batch", (1, 1 << 30, bn, sp))]
        for bn in (32, 64, 128)
        for sp in (8, 16, 32)
    },
    "tile-32-s16-8w": [(PAGED, "small_batch", (1, 1 << 30, 32, 16)), (PAGED, "split_warps", 8)],
    "tiles-old": [(PAGED, "small_batch", None)],
    "narrow-graphs": [(GRAPH, "narrow_tokens", 2048)],
    "argmax-old": [
        (sampler_mod, "plain_greedy", lambda seqs: False),
        (sampler_mod, "lz", _TorchArgmax()),
        (GRAPH, "greedy_in_graph", False),
    ],
    "lm-prefetch": [(GEMV, "prefetch_wide", (4096, 1))],
    "lm-prefetch-8w": [(GEMV, "prefetch_wide", (8192, 8))],
    "splits-1": [(PAGED, "max_splits", 1)],
    "splits-2": [(PAGED, "max_splits", 2)],
    "l2-prefetch": [
        (llama.DecoderLayer, "forward", _layer_l2_prefetch),
        (llama.Attention, "attend", _attend_l2_prefetch),
    ],
    "l2-side-o": [
        (llama.Attention, "attend", _attend_l2_side),
        (llama.LlamaForCausalLM, "forward", _model_forward_joined),
    ],
    "l2-side-o-gu": [
        (llama.DecoderLayer, "forward", _layer_l2_prefetch),
        (llama.Attention, "attend", _attend_l2_side),
        (llama.LlamaForCausalLM, "forward", _model_forward_joined),
        (_FLAGS, "side_gate_up", True),
    ],
    "gemv-old": [(GEMV, "prefetch_warps", 4), (GEMV, "prefetch_long_k", (8192, 4))],
    "2026-11-27": [
        (GEMV, "prefetch_warps", 4),
        (GEMV, "prefetch_long_k", (8192, 4)),
        (ROPE, "block_h_max", 16),
    ],
    "longk-16k-4w": [(GEMV, "prefetch_long_k", (16384, 4))],
    "longk-8k-8w": [(GEMV, "prefetch_long_k", (8192, 8))],
    "split-2w": [(PAGED, "split_warps", 2)],
    "split-8w": [(PAGED, "split_warps", 8)],
    "merge-1w": [(PAGED, "merge_warps", 1)],
    "merge-2w": [(PAGED, "merge_warps", 2)],
    "early-off": [(PAGED, "early_kv", False)],
    "early-on": [(PAGED, "early_kv", True)],
    "trigger-off": [(PAGED, "trigger_first", ()), (GEMV, "trigger_first_rows", 0)],
    "trigger-merge": [(GEMV, "trigger_first_rows", 0)],
    "trigger-gemv": [(PAGED, "trigger_first", ())],
    "trigger-both": [(PAGED, "trigger_first", ("split", "merge"))],
    "one-pass": [(PAGED, "one_pass", True)],
    "no-one-pass": [(PAGED, "one_pass", False)],
    "tiles-28d": [(PAGED, "small_batch", (1, 2048, 32, 16)), (PAGED, "one_pass", False)],
    "one-pass-8w": [(PAGED, "one_pass", True), (PAGED, "split_warps", 8)],
    "one-pass-s32": [(PAGED, "small_batch", (1, 2048, 32, 32)), (PAGED, "one_pass", True)],
    "rope-fused-1p": [(LOCK, "rope_paged_attention", "triton.rope_paged_decode"), (PAGED, "one_pass", True)],
    "rope-fused-1p-s32": [
        (LOCK, "rope_paged_attention", "triton.rope_paged_decode"),
        (PAGED, "one_pass", True),
        (PAGED, "small_batch", (1, 2048, 32, 32)),
    ],
    **{f"rope-bh{n}": [(ROPE, "block_h_max", n)] for n in (1, 2, 4, 8, 16)},
    **{
        f"{name}-16k-8w": [(GEMV, "prefetch_by_shape", ((shape, (16384, 8)),))]
        for name, shape in (
            ("qkv", (4096, 1024)),
            ("o", (1024, 2048)),
            ("gate-up", (6144, 1024)),
            ("down", (1024, 3072)),
        )
    },
    **{
        f"{name}-4w": [(GEMV, "prefetch_by_shape", ((shape, (8192, 4)),))]
        for name, shape in (
            ("qkv", (4096, 1024)),
            ("o", (1024, 2048)),
            ("gate-up", (6144, 1024)),
            ("down", (1024, 3072)),
        )
    },
}


class HostTimer:
    """While installed: host seconds spent in ``CUDAGraph.replay`` and ``torch.cuda.Event.synchronize``, and
    CUDA events on the stream at four marks of each step (the start of ``ModelRunner.execute``, just before
    and after the graph replay, the end of ``Sampler.launch``): the GPU time of a step's input preparation,
    graph and sampling, and the gap before the next step (the GPU waiting for the host)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)
        self.marks: list[tuple[str, torch.cuda.Event]] = []
        self._extra: list[tuple[object, str, object]] = []
        self._orig = (
            torch.cuda.CUDAGraph.replay,
            torch.cuda.Event.synchronize,
            ModelRunner.execute,
            Sampler.launch,
        )

    def _mark(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks.append((name, ev))

    def __enter__(self) -> HostTimer:
        replay, sync, execute, launch = self._orig

        def timed_free(name, fn):
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.times[name].append(time.perf_counter() - t)

            return wrapper

        def timed(name, fn, before=None, after=None):
            def wrapper(obj, *a, **k):
                if before:
                    self._mark(before)
                t = time.perf_counter()
                try:
                    return fn(obj, *a, **k)
                finally:
                    self.times[name].append(time.perf_counter() - t)
                    if after:
                        self._mark(after)

            return wrapper

        for owner, attr in HOST_FUNCS:
            raw = vars(owner)[attr]  # restored as found (a staticmethod stays one)
            self._extra.append((owner, attr, raw))
            free = not isinstance(owner, type) or isinstance(raw, staticmethod)
            fn = getattr(owner, attr)
            setattr(
                owner,
                attr,
                staticmethod(timed_free(attr, fn))
                if isinstance(raw, staticmethod)
                else timed_free(attr, fn)
                if free
                else timed(attr, fn),
            )
        torch.cuda.CUDAGraph.replay = timed("graph.replay", replay, "replay", "replayed")
        torch.cuda.Event.synchronize = timed("event.synchronize", sync)
        ModelRunner.execute = timed("execute", execute, "execute")
        Sampler.launch = timed("sampler.launch", launch, None, "sampled")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self._extra):
            setattr(owner, attr, fn)
        torch.cuda.CUDAGraph.replay, torch.cuda.Event.synchronize, ModelRunner.execute, Sampler.launch = (
            self._orig
        )

    def summary(self) -> str:
        torch.cuda.synchronize()
        seg: dict[str, list[float]] = defaultdict(list)
        names = {
            ("execute", "replay"): "GPU prep",
            ("replay", "replayed"): "GPU graph",
            ("replayed", "sampled"): "GPU sample",
            ("sampled", "execute"): "GPU gap to next step",
        }
        for (a, ea), (b, eb) in itertools.pairwise(self.marks):
            if (a, b) in names:
                seg[names[a, b]].append(ea.elapsed_time(eb) * 1000)
        parts = [
            f"{k} median {statistics.median(v) * 1e6:.0f} / mean {statistics.fmean(v) * 1e6:.0f} µs"
            for k, v in self.times.items()
        ]
        parts += [
            f"{k} median {statistics.median(v):.0f} / mean {statistics.fmean(v):.0f} / max {max(v):.0f} µs"
            for k, v in seg.items()
        ]
        return ", ".join(parts)


def replay_us(graph: torch.cuda.CUDAGraph, reps: int = 200) -> float:
    """µs per replay of ``graph``, back to back (CUDA events around ``reps`` replays after 5 warm ones)."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(reps):
        graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) * 1000 / reps


def run_variant(path: str, name: str, tokens: int, profile_dir: Path | None) -> dict:
    old = []
    graph: dict[str, object] = {}
    knob_blocks = contextlib.ExitStack()
    paged._PLANS.clear()  # triton.paged_decode's per-signature plans (also dropped by every knob change)
    rope_paged._PLANS.clear()  # and triton.rope_paged_decode's, which hold paged_decode's: made afresh
    for mod, attr, value in SETTINGS[name]:
        if mod is LOCK:
            lz.lock(attr, value)
            old.append((mod, attr, None))
        elif mod is GRAPH:
            graph[attr] = value
        elif isinstance(mod, str):
            knob_blocks.enter_context(knobs(mod, **{attr: value}))
        else:
            old.append((mod, attr, vars(mod)[attr]))
            setattr(mod, attr, value)
    try:
        llm = LLM(
            path,
            device="cuda",
            dtype=torch.bfloat16,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=16,
            num_kv_blocks=max(512, -(-MAX_MODEL_LEN // 16)),  # one sequence of max_model_len must fit
            cuda_graph=CudaGraphKnobs(**graph),
        )
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
        for _ in range(2):  # the first generate of a process also warms allocators and clocks
            llm.generate([PROMPT], sp, use_tqdm=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([PROMPT], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        t_stream = time.perf_counter()
        # (perf_counter, tokens so far) per streamed delta: the decode rate without time to first token
        stamps = []
        got = 0
        for delta in llm.stream(PROMPT, sp):
            got += len(delta.outputs[0].token_ids)
            stamps.append((time.perf_counter(), got))
        (t_first, n_first), (t_last, n_last) = stamps[0], stamps[-1]
        decode = (n_last - n_first) / (t_last - t_first)
        with HostTimer() as ht:
            llm.generate([PROMPT], sp, use_tqdm=False)
        graphs = llm.engine.runner.narrow or llm.engine.runner.graphs  # what a batch-1 decode step replays
        res = {
            "variant": name,
            "step_us": wall / tokens * 1e6,
            "tok_s": tokens / wall,
            "decode_tok_s": decode,
            "ttft_ms": (stamps[0][0] - t_stream) * 1e3,
            "replay_us": replay_us(graphs.graphs[1]),
            "greedy_replay_us": (
                replay_us(graphs.greedy_graphs[1, 0]) if (1, 0) in graphs.greedy_graphs else float("nan")
            ),
            "host": ht.summary(),
            "tokens": hashlib.sha1(str(outs[0].outputs[0].token_ids).encode()).hexdigest()[:10],
        }
        if profile_dir is not None:
            res["timeline"] = timeline(llm, sp, profile_dir)
        del llm
        return res
    finally:
        for mod, attr, value in reversed(old):
            if mod is LOCK:
                lz.unlock(attr)
            else:
                setattr(mod, attr, value)
        knob_blocks.close()
        gc.collect()
        torch.cuda.empty_cache()


def timeline(llm: LLM, sp: SamplingParams, out: Path) -> str:
    """Profile one generate; summarise the GPU timeline (busy / idle, largest gaps) and the runtime calls."""
    events = profile_events(
        lambda: llm.generate(
            [PROMPT], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64), use_tqdm=False
        )
    )
    text = summarize(events)
    (out / "timeline.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--variants", default="prefetch,rows")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-timeline", action="store_true")
    ap.add_argument(
        "--prompt-len", type=int, default=256, help="prompt tokens (the KV length decode starts from)"
    )
    ap.add_argument(
        "--max-model-len", type=int, default=2048, help="the engine's max_model_len (graph table width)"
    )
    a = ap.parse_args(argv)
    global PROMPT, MAX_MODEL_LEN
    PROMPT = [7 + (i * 37) % 9000 for i in range(a.prompt_len)]
    MAX_MODEL_LEN = a.max_model_len
    a.out.mkdir(parents=True, exist_ok=True)
    path = default_checkpoint("full", torch.bfloat16)
    names = a.variants.split(",")
    rows = []
    for r in range(a.rounds):
        for i, name in enumerate(names):
            prof = a.out if (r == 0 and i == 0 and not a.no_timeline) else None
            res = run_variant(path, name, a.tokens, prof)
            rows.append(res)
            print(
                f"{name}: step {res['step_us']:.0f} µs ({res['tok_s']:.0f} tok/s), decode "
                f"{res['decode_tok_s']:.0f} tok/s after {res['ttft_ms']:.1f} ms to the first token, replay "
                f"{res['replay_us']:.0f} µs (greedy graph {res['greedy_replay_us']:.0f}); {res['host']}; "
                f"tokens {res['tokens']}",
                flush=True,
            )
    lines = [
        f"# Batch-1 decode A/B on {torch.cuda.get_device_name()} (Qwen3-0.6B shape, bf16, greedy, "
        f"{a.prompt_len}-token prompt, {a.tokens} new tokens, max_model_len {a.max_model_len}; torch "
        f"{torch.__version__})",
        "",
        "whole step = generate wall time / new tokens (time to first token included); decode = tokens after "
        "the first / time after it (streamed).",
        "",
        "| variant | whole step µs | tok/s | decode tok/s | first token ms | graph replay µs | greedy graph "
        "replay µs | host calls |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    lines += [
        f"| {r['variant']} | {r['step_us']:.0f} | {r['tok_s']:.0f} | {r['decode_tok_s']:.0f} | "
        f"{r['ttft_ms']:.1f} | {r['replay_us']:.0f} | {r['greedy_replay_us']:.0f} | {r['host']} |"
        for r in rows
    ]
    (a.out / "batch1_ab.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
