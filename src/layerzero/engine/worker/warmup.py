"""Start-up warm-up (vLLM's ``compile_or_warm_up_model``): dummy steps over the shapes the scheduler can
produce and every sampler path, run once when the worker is built (after the CUDA graphs are captured), so the
first-use costs land there and not in the first requests: Triton's JIT compiles (a kernel is compiled per
``constexpr`` set and per integer-argument specialization: equal to 1, divisible by 16), LayerZero's selection
of each new shape bucket (token counts, batch sizes and KV widths bucketed to powers of two:
``layerzero.core.context.bucket``), FlashInfer's modules and plans, the allocator's first large blocks, and
each decode graph's first launch.

What it runs (:func:`plan_steps`, :func:`plan_sampler`; the budget B = ``max_num_batched_tokens``, S =
``max_num_seqs``, L = ``max_model_len``):

- prefill: for each token count T of :func:`token_ladder` (2..16, the powers of two up to B, and B), a step of
  T tokens in as few sequences as L allows, and, above 16, a ragged step of T - 1 tokens over several
  sequences whose first one continues a chunked prefill (its KV longer than its chunk);
- mixed: D decode rows (:func:`decode_ladder`: 1..16, b and b - 1 for powers of two b < S, and S - 1) beside
  the prefill chunks filling the rest of the budget, and beside one short odd chunk;
- decode, eagerly, only where decode steps run eager (``enforce_eager``, CPU, graphs that failed to
  capture): every batch size of :func:`row_ladder` (1..16, b and b - 1 for each power of two b <= S, and
  S), and batch 1 over KV lengths in power-of-two blocks up to L; with CUDA graphs every captured graph is
  replayed once instead (capture already ran their kernels);
- attention: one layer's paged attention alone for every feasible bucket of (sequences, tokens, widest block
  table) (:func:`plan_attention`: its key buckets all three, too many combinations for whole steps);
- cascade attention (when the runner's cascade policy is on): a small and a large step of decode rows and a
  new chunk sharing prefix blocks (decode-only too where decode is eager);
- the sampler, on random logits of every :func:`row_ladder` row count: each path of :data:`SAMPLER_PATHS`,
  and structured outputs' ``lz.apply_token_bitmask`` on all of a step's rows and on a subset.

Nothing is kept: every token's KV slot is -1 (the cache kernels skip it: the KV pools are unchanged; reads
see the zeroed pool), the forwards bypass the runner's counters, the int8 KV calibration waits for the first
real prefill, and the sampler's generator and torch's global random states are restored afterwards. The
scheduler and the KV cache manager are not built yet when it runs."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

import layerzero as lz

from ..config import EngineConfig
from ..core.sched.output import SamplingMetadata
from ..layers.attention import KVScales, paged_attention
from ..sampling_params import SamplingParams
from .cascade import CascadePolicy
from .grammar_bitmask import bitmask_warmup_plan, warm_bitmask
from .input_batch import ScheduledChunk, build_forward_batch

__all__ = [
    "SAMPLER_PATHS",
    "WarmupReport",
    "WarmupStep",
    "decode_ladder",
    "maybe_warm_up",
    "plan_attention",
    "plan_sampler",
    "plan_steps",
    "row_ladder",
    "token_ladder",
    "warm_up",
    "warmup_enabled",
]

log = logging.getLogger("layerzero.engine")

SAMPLER_PATHS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "greedy_logprobs": {"temperature": 0.0, "logprobs": 5},
    "temperature": {"temperature": 0.6},
    "seeded": {"temperature": 0.8, "seed": 1234},
    "top_k": {"temperature": 1.0, "top_k": 20},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "top_k_top_p": {"temperature": 1.0, "top_k": 20, "top_p": 0.9},
    "min_p": {"temperature": 1.0, "min_p": 0.05},
    "penalties": {
        "temperature": 0.7,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
    },
    "bias_min_tokens": {"temperature": 1.0, "logit_bias": {0: 1.0}, "min_tokens": 4},
    "mixed": {},  # rows alternate greedy and temperature 0.6 (one step with both)
}
"""The sampler paths warmed, as ``SamplingParams`` fields: plain greedy (``lz.sample_greedy`` on the model's
dtype), greedy with logprobs (float32, ``log_softmax`` + top-k), temperature alone (``layerzero
bench-engine``'s), a seeded request's own stream, each filter, penalties, logit bias with the min_tokens ban,
and a step mixing greedy and sampled rows."""


@dataclass(frozen=True)
class WarmupStep:
    """One dummy step: ``kind`` (``"prefill"``, ``"mixed"``, ``"decode"``, ``"cascade"``) and its chunks, each
    ``(start, length)``: the tokens at positions ``start .. start + length - 1`` of one sequence (its KV is
    ``start + length`` long). A cascade step's sequences share their first ``shared_blocks`` blocks."""

    kind: str
    chunks: tuple[tuple[int, int], ...]
    shared_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.num_tokens}x{self.num_seqs}"


@dataclass
class WarmupReport:
    """What :func:`warm_up` ran: ``seconds`` (host wall time, the device synchronized at the end), forward
    ``steps``, single ``attention`` calls (:func:`plan_attention`), ``sampler`` shapes (path x rows),
    ``graphs`` replayed, and ``failed``: labels of dummy runs that raised (logged; the real steps of those
    shapes would raise too)."""

    seconds: float = 0.0
    steps: int = 0
    attention: int = 0
    sampler: int = 0
    graphs: int = 0
    failed: list[str] = field(default_factory=list)

    @property
    def shapes(self) -> int:
        """Dummy runs in all: forward steps, attention calls, sampler shapes and graph replays."""
        return self.steps + self.attention + self.sampler + self.graphs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"shapes": self.shapes}


def _pow2_upto(n: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b <= n:
        out.append(b)
        b *= 2
    return out


EXACT_ROWS = 16
"""Row counts up to this are exact in ``lz.linear``'s selection key (``layerzero.ops.linear.EXACT_ROWS``: the
skinny-GEMM kernels are chosen per M), so every count up to it is its own bucket."""


def token_ladder(budget: int) -> list[int]:
    """Prefill token counts: every count from 2 to :data:`EXACT_ROWS`, the powers of two up to ``budget``
    (LayerZero's selection buckets of a step's tokens), and ``budget`` itself (the steady chunked-prefill
    step)."""
    small = set(range(2, min(EXACT_ROWS, budget) + 1))
    return sorted(small | set(_pow2_upto(budget, 2)) | ({budget} if budget >= 2 else set()))


def row_ladder(max_num_seqs: int) -> list[int]:
    """Row counts (decode batch sizes, sampled rows): every count up to :data:`EXACT_ROWS`, each power of two
    b <= ``max_num_seqs`` and b - 1 (the bucket's upper bound and a count inside it that is not a multiple of
    16: Triton specializes integer arguments on divisibility by 16 and on == 1), and ``max_num_seqs`` and one
    less."""
    rows = set(range(1, min(EXACT_ROWS, max_num_seqs) + 1))
    for b in _pow2_upto(max_num_seqs):
        rows |= {b, b - 1}
    rows |= {max_num_seqs, max_num_seqs - 1}
    return sorted(r for r in rows if r >= 1)


def decode_ladder(max_num_seqs: int) -> list[int]:
    """Decode rows beside a prefill chunk in a mixed step: :func:`row_ladder` of ``max_num_seqs - 1`` (the
    chunk is one more sequence)."""
    return row_ladder(max_num_seqs - 1) if max_num_seqs > 1 else []


def _split(tokens: int, seqs: int, cap: int) -> list[int]:
    """``tokens`` as ``seqs`` ragged lengths (each >= 1 and <= ``cap`` where possible; the first one longer),
    summing to ``tokens``."""
    seqs = max(1, min(seqs, tokens))
    base, extra = divmod(tokens, seqs)
    lens = [base + (1 if i < extra else 0) for i in range(seqs)]
    move = min(lens[-1] - 1, max(1, base // 3), cap - lens[0])
    if seqs >= 2 and move > 0:  # ragged: move a few tokens from the last sequence to the first
        lens[0] += move
        lens[-1] -= move
    return lens


def _prefill_chunks(
    tokens: int, seqs: int, max_model_len: int, continue_first: bool
) -> list[tuple[int, int]]:
    """Chunks of ``tokens`` tokens over at least ``seqs`` sequences, none longer than ``max_model_len``; with
    ``continue_first`` the first chunk starts after as many positions as it has (a chunked prefill's second
    chunk) when its KV fits."""
    seqs = max(seqs, -(-tokens // max_model_len))
    lens = _split(tokens, seqs, max_model_len)
    chunks = [(0, n) for n in lens]
    if continue_first and 2 * lens[0] <= max_model_len:
        chunks[0] = (lens[0], lens[0])
    return chunks


def _decode_rows(n: int, max_kv: int) -> list[tuple[int, int]]:
    """``n`` decode chunks whose KV lengths spread over ``2 .. max_kv``."""
    if n == 1:
        return [(max_kv - 1, 1)]
    return [(1 + (i * (max_kv - 2)) // (n - 1), 1) for i in range(n)]


def plan_steps(
    budget: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    eager_decode: bool,
    cascade: bool,
) -> list[WarmupStep]:
    """The dummy forward steps (module docstring): every one within the scheduler's bounds (at most
    ``budget`` tokens and ``max_num_seqs`` sequences, every KV at most ``max_model_len``)."""
    S, L = max_num_seqs, max_model_len
    steps: list[WarmupStep] = []
    for t in token_ladder(budget):
        chunks = _prefill_chunks(t, 1, L, continue_first=False)
        if len(chunks) <= S:
            steps.append(WarmupStep("prefill", tuple(chunks)))
        if t > EXACT_ROWS:  # a ragged step inside the bucket, several sequences, one continuing
            k = min(S, max(2, (t - 1) // 256))
            chunks = _prefill_chunks(t - 1, k, L, continue_first=True)
            if len(chunks) <= S:
                steps.append(WarmupStep("prefill", tuple(chunks)))
    if L >= 2:
        for d in decode_ladder(S):
            rest = budget - d
            for size, max_kv in ((rest, max(2, L // 2)), (min(rest, block_size + 1), L)):
                if size < 2:
                    continue
                chunks = _prefill_chunks(size, 1, L, continue_first=False)
                if d + len(chunks) <= S:
                    steps.append(WarmupStep("mixed", tuple(_decode_rows(d, max_kv) + chunks)))
        if eager_decode:
            steps += [WarmupStep("decode", tuple(_decode_rows(n, L))) for n in row_ladder(S) if n <= budget]
            kv = sorted({min(L, b * block_size) for b in _pow2_upto(-(-L // block_size))} | {L})
            steps += [WarmupStep("decode", ((n - 1, 1),)) for n in kv if n >= 2]
    if cascade:
        steps += _cascade_steps(budget, S, L, block_size, eager_decode)
    return steps


def _cascade_steps(budget: int, S: int, L: int, bs: int, eager_decode: bool) -> list[WarmupStep]:
    """Cascade steps: (members, shared blocks) small (4, 2) and large (16, up to 64 blocks), decode rows
    past the shared prefix plus one chunk starting at it (and decode-only where decode is eager)."""
    steps = []
    for members, shared in ((4, 2), (16, min(64, max(2, (L // 2) // bs)))):
        members = min(members, S - 1)
        prefix = shared * bs
        chunk = min(bs * 4 + 1, budget - members, L - prefix)
        if members < 2 or prefix + 2 > L or chunk < 2:
            continue
        rows = [(prefix + 1 + i % bs, 1) for i in range(members)]
        steps.append(WarmupStep("cascade", (*rows, (prefix, chunk)), shared))
        if eager_decode:
            steps.append(WarmupStep("cascade", tuple(rows), shared))
    return steps


def plan_sampler(max_num_seqs: int) -> list[tuple[str, int]]:
    """(path of :data:`SAMPLER_PATHS`, rows) for every path and every :func:`row_ladder` row count."""
    return [(path, n) for path in SAMPLER_PATHS for n in row_ladder(max_num_seqs)]


def _bucket(n: int) -> int:
    return n if n <= 1 else 1 << (n - 1).bit_length()


def plan_attention(
    budget: int, max_num_seqs: int, max_model_len: int, block_size: int, decode: bool
) -> list[tuple[tuple[int, int], ...]]:
    """Chunk sets (``(start, length)`` per sequence) covering ``lz.paged_attention``'s selection buckets: its
    key buckets three step facts at once (sequences, tokens, the widest block table), more combinations than
    whole dummy steps can afford, so each is one attention call (:func:`warm_up`). Every feasible (sequences
    b, tokens t, width w) of the power-of-two buckets up to ``max_num_seqs``, ``budget`` and ``max_model_len``
    (a bucket's top value capped at the bound): t > b (prefill; the first sequence's KV exactly w blocks) and,
    with ``decode``, t == b (one token each)."""
    cap_w = -(-max_model_len // block_size)
    widths = sorted({min(w, cap_w) for w in _pow2_upto(_bucket(cap_w))})
    batches = sorted({min(b, max_num_seqs) for b in _pow2_upto(_bucket(max_num_seqs))})
    tokens = sorted({min(t, budget) for t in _pow2_upto(_bucket(budget), 2)})
    out: list[tuple[tuple[int, int], ...]] = []
    for b in batches:
        for w in widths:
            kv = min(w * block_size, max_model_len)
            for t in tokens:
                if t <= b or t > b * kv:
                    continue
                lens = _split(t, b, kv)
                if len(lens) != b or max(lens) > kv:
                    continue
                out.append(((kv - lens[0], lens[0]), *((0, n) for n in lens[1:])))
            if decode and b <= budget and kv >= 2:
                out.append(((kv - 1, 1), *_decode_rows(b - 1, kv)) if b > 1 else ((kv - 1, 1),))
    return out


def warmup_enabled(ec: EngineConfig, device: torch.device) -> bool:
    """``ec.warmup``, or (None) whether ``device`` is CUDA: CPU kernels have no JIT to warm."""
    return ec.warmup if ec.warmup is not None else device.type == "cuda"


def maybe_warm_up(ec: EngineConfig, runner: Any, sampler: Any, budget: int) -> WarmupReport | None:
    """:func:`warm_up` (``budget``: the step's token budget, ``max_num_batched_tokens``) when
    :func:`warmup_enabled`, else None."""
    if not warmup_enabled(ec, runner.device):
        return None
    return warm_up(runner, sampler, ec.max_num_seqs, budget)


def warm_up(runner: Any, sampler: Any, max_num_seqs: int, budget: int) -> WarmupReport:
    """Run :func:`plan_steps`' forwards through ``runner`` (a :class:`~.model_runner.ModelRunner`), replay
    its decode graphs once and run :func:`plan_sampler`'s draws through ``sampler`` (a
    :class:`~.sampler.Sampler`); see the module docstring for what is left unchanged.

    Raises:
        LayerZeroError: a dummy run raised in strict mode (``lz.configure(strict=True)``); otherwise the
            failure is logged and listed in the report."""
    report = WarmupReport()
    t0 = time.perf_counter()
    dev = runner.device
    eager_decode = runner.graphs is None
    steps = plan_steps(
        budget,
        max_num_seqs,
        runner.max_model_len,
        runner.block_size,
        eager_decode,
        runner.cascade is not None,
    )
    scales = [m for m in runner.model.modules() if isinstance(m, KVScales) and m.calibrate]
    rng = torch.get_rng_state(), (torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
    gen = sampler.generator.get_state()
    for m in scales:  # the first real prefill calibrates an int8 pool, not a dummy one
        m.calibrate = False
    try:
        with torch.no_grad():
            for step in steps:
                if _attempt(report, step.label, lambda s=step: _forward(runner, s)):
                    report.steps += 1
            layer = next(m for m in runner.model.modules() if hasattr(m, "kv_scales") and hasattr(m, "scale"))
            width = max(cfg_heads(runner))
            qkv = torch.zeros(budget, width, runner.cfg.head_dim, dtype=runner.dtype, device=dev)
            for chunks in plan_attention(
                budget, max_num_seqs, runner.max_model_len, runner.block_size, eager_decode
            ):
                step = WarmupStep("attention", chunks)
                if _attempt(report, step.label, lambda s=step: _attend(runner, layer, qkv, s)):
                    report.attention += 1
            report.graphs = _replay_graphs(runner)
            vocab = runner.cfg.vocab_size
            for path, n in plan_sampler(max_num_seqs):
                if _attempt(
                    report, f"sample/{path}/{n}", lambda p=path, k=n: _sample(sampler, p, k, vocab, runner)
                ):
                    report.sampler += 1
            for n, sub in bitmask_warmup_plan(row_ladder(max_num_seqs)):  # structured outputs' grammar masks
                if _attempt(report, f"bitmask/{n}/{sub}", lambda k=n, b=sub: warm_bitmask(k, b, vocab, dev)):
                    report.sampler += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    finally:
        for m in scales:
            m.calibrate = True
        sampler.generator.set_state(gen)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], dev)
    report.seconds = time.perf_counter() - t0
    log.info(
        "warm-up: %d forward steps, %d attention calls, %d sampler shapes, %d graph replays (%d shapes) in "
        "%.2f s%s",
        report.steps,
        report.attention,
        report.sampler,
        report.graphs,
        report.shapes,
        report.seconds,
        f"; {len(report.failed)} failed: {report.failed[:4]}" if report.failed else "",
    )
    return report


def _attempt(report: WarmupReport, label: str, fn: Any) -> bool:
    """Run ``fn``; a failure is logged and listed (re-raised in strict mode)."""
    try:
        fn()
        return True
    except Exception as exc:
        if lz.get_config().strict:
            raise
        report.failed.append(label)
        log.warning(
            "warm-up %s failed (a real step of this shape would too): %s: %s", label, type(exc).__name__, exc
        )
        return False


def _batch(runner: Any, step: WarmupStep) -> Any:
    """The :class:`ForwardBatch` of a dummy step, every KV slot -1 (nothing is written)."""
    bs = runner.block_size
    widths = [-(-(s + n) // bs) for s, n in step.chunks]
    tables = np.zeros((step.num_seqs, max(widths)), dtype=np.int32)
    shared = step.shared_blocks
    nxt = shared
    for i, w in enumerate(widths):
        if shared:  # cascade: the shared blocks, then blocks of its own
            tables[i, :shared] = np.arange(shared)
            tables[i, shared:w] = np.arange(nxt, nxt + w - shared)
            nxt += w - shared
        else:  # every row the same blocks: nothing is written, and reads only need valid ids
            tables[i, :w] = np.arange(w)
    if int(tables.max()) >= runner.num_blocks:
        raise RuntimeError(
            f"{step.label}: needs {int(tables.max()) + 1} KV blocks, the pool has {runner.num_blocks}"
        )
    vocab = runner.cfg.vocab_size
    chunks = [
        ScheduledChunk([(7 * p + 3) % vocab for p in range(s, s + n)], s, n, (), True, None, s)
        for s, n in step.chunks
    ]
    policy = CascadePolicy(always=True) if shared else None
    batch = build_forward_batch(chunks, bs, runner.device, None, policy, tables)
    batch.slot_mapping.fill_(-1)  # write no KV: the pool stays as it is
    return batch


def _forward(runner: Any, step: WarmupStep) -> None:
    """One dummy step through the runner's eager forward (the kernels its real steps select); no KV
    written."""
    runner._eager(_batch(runner, step))


def cfg_heads(runner: Any) -> tuple[int, int]:
    """(query heads, KV heads) of the runner's model (this rank's, under tensor parallelism)."""
    m = runner.model
    return getattr(m, "num_local_heads", runner.cfg.num_heads), getattr(
        m, "num_local_kv_heads", runner.cfg.num_kv_heads
    )


def _attend(runner: Any, layer: Any, qkv: torch.Tensor, step: WarmupStep) -> None:
    """One layer's eager paged attention (``layers.attention.paged_attention``, the call an eager step's
    layer makes, quantized pools included) for ``step``'s chunks, on zeros; no KV written."""
    batch = _batch(runner, step)
    hq, hkv = cfg_heads(runner)
    t = step.num_tokens
    q, k, v = qkv[:t, :hq], qkv[:t, :hkv], qkv[:t, :hkv]
    if batch.is_decode and runner.decode_as_captured:
        with lz.capture_selection():
            paged_attention(q, k, v, runner.kv_caches[0], batch, layer.scale, layer.kv_scales)
    else:
        paged_attention(q, k, v, runner.kv_caches[0], batch, layer.scale, layer.kv_scales)


def _replay_graphs(runner: Any) -> int:
    """Replay every captured decode graph once (its first launch uploads it); their buffers still hold the
    capture's dummy step (slot -1: no KV written). Returns how many."""
    seen: dict[int, Any] = {}
    for g in (runner.narrow, runner.graphs):
        if g is None:
            continue
        for d in (g.graphs, g.lane_graphs, g.greedy_graphs, g.cascade_graphs):
            for graph in d.values():
                seen[id(graph)] = graph
    for graph in seen.values():
        graph.replay()
    return len(seen)


def _sample(sampler: Any, path: str, n: int, vocab: int, runner: Any) -> None:
    """Draw ``n`` rows of ``path`` from random logits (the model's dtype, as the model returns them)."""
    kw = SAMPLER_PATHS[path]
    if path == "mixed":
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.6) for i in range(n)]
    else:
        params = [SamplingParams(**kw)] * n
    rows = SamplingMetadata()
    for i, p in enumerate(params):
        rows.params.append(p)
        rows.seeds.append(p.seed)
        rows.num_output_tokens.append(2 + i % 3)
        pen = p.penalized
        rows.prompt_token_ids.append([(5 * i + j) % vocab for j in range(3 + i % 4)] if pen else None)
        rows.output_token_ids.append([(11 * i + j) % vocab for j in range(2 + i % 3)] if pen else None)
    logits = torch.randn(n, vocab, device=runner.device).to(runner.dtype)
    sampler(logits, rows)
