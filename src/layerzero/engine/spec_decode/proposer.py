"""Device-side drafts (:class:`DraftProposer`): ``"draft_model"`` (a second small model with its own KV pool,
addressed by the target's block tables and slots, so no second block manager) and ``"layer_skip"`` (the
target's first m layers, its final norm and LM head; their KV is the target's, which the verification forward
rewrites). Drafts are greedy (the draft's argmax: q is one-hot in the verification)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import layerzero as lz

from ..config import CudaGraphKnobs, EngineConfig, ModelConfig
from ..core.sched.output import SchedulerOutput
from ..loader import load_dummy_weights, load_model_weights
from ..models.registry import build_model
from ..worker.attn_metadata import ForwardBatch
from ..worker.cuda_graph import CUDAGraphRunner
from ..worker.input_batch import ScheduledChunk, build_forward_batch
from ..worker.staging import to_device
from .ahead import AHEAD_MAX_ROWS, Ahead, ahead_batch, ahead_drafts
from .config import SpeculativeConfig

__all__ = ["DraftProposer", "load_draft"]

log = logging.getLogger("layerzero.engine")


def load_draft(
    spec: SpeculativeConfig | None,
    ec: EngineConfig,
    tcfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> tuple[nn.Module | None, int]:
    """The draft model of a ``"draft_model"`` config (loaded before the target's KV pool is sized, so its
    weights are not in the memory the pool takes) and the bytes its KV takes per block of the target's pool
    (the pool is sized for both: ``ModelRunner(extra_kv_bytes_per_block=...)``); ``(None, 0)`` for other
    methods. ``ec.load_format="dummy"``: seeded random weights with the engine's seed (a draft with the
    target's config then equals the target).

    Raises:
        ConfigurationError: the draft's config is unreadable or unsupported, or its vocabulary differs from
            the target's."""
    if spec is None or spec.method != "draft_model":
        return None, 0
    dcfg = ModelConfig.from_pretrained(spec.model)
    spec.check_model(tcfg.num_layers, tcfg.vocab_size, dcfg.vocab_size)
    model = build_model(dcfg, max_model_len, device, dtype)
    if ec.load_format == "dummy":
        load_dummy_weights(model, ec.seed)
    else:
        load_model_weights(model, spec.model)
    hkv = getattr(model, "num_local_kv_heads", dcfg.num_kv_heads)
    per_block = dcfg.num_layers * 2 * ec.block_size * hkv * dcfg.head_dim * dtype.itemsize
    log.info("draft model %s: %d layers", spec.model, dcfg.num_layers)
    return model, per_block


class _FirstLayers(nn.Module):
    """The target's first ``m`` layers, final norm and LM head as a model (``forward(batch, kv_caches)`` ->
    logits of every row): layer skip's draft, in a form the CUDA-graph runner captures."""

    def __init__(self, model: Any, m: int) -> None:
        super().__init__()
        self.target, self.m = model, m

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        t = self.target
        x, residual = t.embed_tokens(batch.input_ids), None
        for layer, cache in zip(t.layers[: self.m], kv_caches[: self.m], strict=True):
            x, residual = layer(x, residual, batch, cache)
        return t.compute_logits(t.norm(x, residual)[0])


class DraftProposer:
    """Proposes a draft model's (or the target's first layers') drafts for a verification step.

    ``runner``: the target's :class:`~layerzero.engine.worker.model_runner.ModelRunner` (its model, KV pools,
    block size); ``draft``: :func:`load_draft`'s model (``"draft_model"``), else None. A draft model gets one
    KV pool per layer of ``runner.num_blocks`` blocks: the draft's KV of a token lives at the target's slot
    of that token. It mirrors every target forward (:meth:`mirror`: prefill chunks, decode and verification
    steps), so a block the prefix cache shares holds the draft's KV of its tokens too. On CUDA (unless
    ``enforce_eager``) the draft's decode steps replay CUDA graphs (one per batch bucket, plain inputs);
    when their capture fails the drafts run eager (logged; strict mode raises).

    A greedy verification step also launches the next round's first draft step before it is read
    (:meth:`ahead_hook`, :mod:`.ahead`); :meth:`propose` takes its drafts when the next round is the one it
    assumed. ``ahead_launched`` / ``ahead_used`` count them; ``ahead_max_rows`` (default
    :data:`.ahead.AHEAD_MAX_ROWS`) bounds the steps that launch it, 0 turns it off (the benchmark's A/B).

    Raises:
        ConfigurationError: ``num_layers`` out of range (``SpeculativeConfig.check_model``)."""

    def __init__(
        self, spec: SpeculativeConfig, runner: Any, ec: EngineConfig, max_model_len: int, draft: Any = None
    ) -> None:
        self.spec, self.runner = spec, runner
        tcfg = runner.cfg
        if spec.method == "layer_skip":
            spec.check_model(tcfg.num_layers, tcfg.vocab_size)
            self.model: Any = _FirstLayers(runner.model, spec.num_layers)
            self.kv: list[torch.Tensor] = runner.kv_caches
        else:
            self.model = draft
            dcfg = draft.cfg
            hkv = getattr(draft, "num_local_kv_heads", dcfg.num_kv_heads)
            self.kv = [
                lz.allocate_kv_cache(
                    runner.num_blocks,
                    runner.block_size,
                    hkv,
                    dcfg.head_dim,
                    runner.dtype,
                    "NHD",
                    runner.device,
                )
                for _ in range(dcfg.num_layers)
            ]
        self.ahead: Ahead | None = None
        self.ahead_launched = self.ahead_used = 0
        self.ahead_max_rows = AHEAD_MAX_ROWS
        self.graphs: CUDAGraphRunner | None = None
        if runner.device.type == "cuda" and not ec.enforce_eager:
            self.graphs = self._capture(ec, max_model_len)

    def _capture(self, ec: EngineConfig, max_model_len: int) -> CUDAGraphRunner | None:
        knobs = CudaGraphKnobs(packed_inputs=False, greedy_in_graph=False)
        rows = min(ec.max_num_seqs * (1 + self.spec.num_speculative_tokens), 512)  # as the target's graphs
        graphs = CUDAGraphRunner(
            self.model,
            self.kv,
            max(rows, ec.max_num_seqs),
            -(-max_model_len // ec.block_size),
            self.runner.device,
            knobs=knobs,
        )
        try:
            graphs.capture()
        except Exception as exc:  # noqa: BLE001 - any capture failure: drafts run eager, logged
            if lz.get_config().strict:
                raise
            log.warning("speculative decoding: draft CUDA graphs off (drafts run eager): %s", exc)
            return None
        return graphs

    @property
    def mirrors(self) -> bool:
        """Whether the draft has its own KV pool that every target forward must also fill."""
        return self.spec.method == "draft_model"

    @torch.no_grad()
    def mirror(self, batch: ForwardBatch) -> None:
        """Run the draft over a target step's batch (the same ids, positions and slots): its KV pool then
        holds the draft's KV of every token the target computed (rejected drafts' positions included,
        overwritten later as the target's are). A decode step replays the draft's CUDA graphs when they hold
        it."""
        if self.graphs is not None and self.graphs.can_run(batch):
            self.graphs.run(batch)
            return
        self.model.hidden_states(batch, self.kv)

    def ahead_hook(self, out: SchedulerOutput) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """For the verification step ``out``: the ``before_read`` of
        :func:`~layerzero.engine.spec_decode.verify.verify_step` that queues the next round's first draft
        step behind the verification's result (:func:`.ahead.ahead_batch`), or None when the step does not
        launch it (:func:`.ahead.ahead_drafts`: a sampled row, a plain or prefill chunk, unequal draft counts,
        a row that may end, a chunk that ends a block, more than ``ahead_max_rows`` rows). Call
        :meth:`settle` with the accepted counts once the step is read."""
        self.ahead = None
        bs = self.runner.block_size
        if not ahead_drafts(out, bs, self.ahead_max_rows):
            return None

        @torch.no_grad()
        def launch(tokens: torch.Tensor, accepted: torch.Tensor) -> None:
            drafts = self._logits(ahead_batch(out, tokens, accepted, bs)).argmax(dim=-1)
            self.ahead = Ahead(list(out.seq_ids), list(out.num_computed_tokens), drafts)
            self.ahead_launched += 1

        return launch

    def settle(self, accepted: list[int]) -> None:
        """The launched first draft step's rows' accepted counts, read from the verification (in row
        order); nothing without one."""
        if self.ahead is not None:
            self.ahead.accepted = accepted

    def drop_ahead(self) -> None:
        """Forget a launched first draft step (a failed step was rolled back)."""
        self.ahead = None

    def _take_ahead(self, out: SchedulerOutput, chunks: list[int], sampled: bool) -> torch.Tensor | None:
        """The launched first draft step's drafts ``[R]`` when ``out``'s speculating ``chunks`` are the
        round it assumed (greedy: ``sampled`` False), else None; either way it is spent."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or sampled or not ahead.matches(out, chunks):
            return None
        self.ahead_used += 1
        return ahead.tokens

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model(batch, self.kv)

    @torch.no_grad()
    def propose(
        self, out: SchedulerOutput, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Drafts for the speculating chunks of ``out`` (``spec_token_ids`` of -1s; their last token known, at
        position ``num_computed_tokens``): k draft decode steps, step j feeding position P + j the previous
        step's draft (the last token at j = 0) and writing the draft's KV there (slots the scheduler allocated
        for the verification chunk). Greedy rows draft the draft model's argmax; sampled rows draw from the
        draft's distribution q after the request's temperature / top-k / top-p / min-p
        (``lz.sampling_probs``), seeded rows from counter-based noise of (seed, output position)
        in a stream of their own (the seed xor a salt), others from ``generator``.

        Returns ``(drafts, rows, ids, q)``: ``drafts`` ``[R, K]`` int64 on the device, one row per
        speculating chunk in order (entries past a row's count 0); the verification batch's input rows
        ``[D]`` / ids ``[D]`` where they go (``ModelRunner.execute``'s ``spec_inputs``); ``q`` ``[R, K, V]``
        float32, the draft distributions the verification needs, or None when every row is greedy (q
        one-hot)."""
        dev, bs = self.runner.device, self.runner.block_size
        chunks = [i for i, d in enumerate(out.spec_token_ids) if d]
        counts = [len(out.spec_token_ids[i]) for i in chunks]
        starts = [out.num_computed_tokens[i] for i in chunks]
        k = max(counts)
        tables = out.block_tables[chunks]
        acts = [[r for r, c in enumerate(counts) if c > j] for j in range(k)]
        # where the drafts go in the verification batch: chunk i's rows cu[i] + 1 .. cu[i] + count
        cu = np.concatenate([[0], np.cumsum(out.num_scheduled_tokens)])
        rows = np.concatenate(
            [np.arange(cu[i] + 1, cu[i] + 1 + c) for i, c in zip(chunks, counts, strict=True)]
        )
        take = np.concatenate([np.arange(c) + r * k for r, c in enumerate(counts)])
        i64 = np.int64
        host = [
            np.asarray([out.new_token_ids[i][0] for i in chunks], i64),
            rows.astype(i64),
            take.astype(i64),
        ]
        host += [np.asarray(a, i64) for a in acts]
        srow = np.cumsum(out.sample) - 1  # chunk -> its row of out.sampling
        ps = [out.sampling.params[srow[i]] for i in chunks]
        sampled = not all(p.greedy for p in ps)
        seeded: list[int] = []
        if sampled:
            seeded = [
                r
                for r, i in enumerate(chunks)
                if out.sampling.seeds[srow[i]] is not None and not ps[r].greedy
            ]
            host += _param_arrays(ps, [out.sampling.seeds[srow[chunks[r]]] for r in seeded], seeded)
            host.append(np.asarray([out.sampling.num_output_tokens[srow[chunks[r]]] for r in seeded], i64))
        staged = to_device(host, dev)  # one staged copy (a pageable one would sync)
        last, rows_t, take_t = staged[:3]
        act_t = staged[3 : 3 + k]
        drafts = torch.zeros(len(chunks), k, dtype=torch.int64, device=dev)
        whole = len(acts[-1]) == len(chunks)  # every row takes all k drafts: no row indexing
        q = None
        if sampled:
            temp, top_k, top_p, min_p, si, seeds, base = staged[3 + k :]
            used = (
                any(p.top_k_or_off for p in ps),
                any(p.top_p < 1.0 for p in ps),
                any(p.min_p > 0.0 for p in ps),
            )
            q = torch.zeros(len(chunks), k, self.runner.cfg.vocab_size, dtype=torch.float32, device=dev)
        first = self._take_ahead(out, chunks, sampled)
        for j in range(k):
            act = acts[j]
            if j == 0 and first is not None:  # launched behind the last verification (ahead_hook)
                drafts[:, 0] = first
                continue
            sched = [ScheduledChunk([0], starts[r] + j, 1, (), True, None, starts[r] + j) for r in act]
            batch = build_forward_batch(sched, bs, dev, None, None, np.ascontiguousarray(tables[act]))
            if j == 0:
                ids = last if whole else last.index_select(0, act_t[0])
            else:
                ids = drafts[:, j - 1] if whole else drafts[act_t[j], j - 1]
            batch.input_ids.copy_(ids)
            logits = self._logits(batch)
            if not sampled:
                tok = logits.argmax(dim=-1)
            else:
                a = None if whole else act_t[j]
                cuts = [
                    None if not on else _rows(t, a) for t, on in zip((top_k, top_p, min_p), used, strict=True)
                ]
                qj = lz.sampling_probs(logits.float(), _rows(temp, a), *cuts)  # a cut no row uses: skipped
                e = torch.empty(len(chunks), qj.shape[-1], device=dev).exponential_(generator=generator)
                if seeded:
                    e[si] = lz.seeded_exponential(seeds ^ DRAFT_SALT, base + j, qj.shape[-1]).float()
                e = _rows(e, a).clamp_min(torch.finfo(torch.float32).tiny)
                tok = torch.argmax(torch.log(qj) - torch.log(e), dim=-1)
                if whole:
                    q[:, j] = qj
                else:
                    q[act_t[j], j] = qj
            if whole:
                drafts[:, j] = tok
            else:
                drafts[act_t[j], j] = tok
        return drafts, rows_t, drafts.reshape(-1).index_select(0, take_t), q


def _rows(t: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return t if idx is None else t.index_select(0, idx)


DRAFT_SALT = 0x5DEECE66D
"""Xored into a seeded row's seed for its drafts' noise: a stream apart from the verification's."""


def _param_arrays(ps: list[Any], seeds: list[int], seeded: list[int]) -> list[np.ndarray]:
    """Per row temperature (float32), top-k (int64, 0 = off), top-p, min-p (float32), then the seeded rows'
    indices and seeds (int64)."""
    return [
        np.asarray([p.temperature for p in ps], np.float32),
        np.asarray([p.top_k_or_off for p in ps], np.int64),
        np.asarray([p.top_p for p in ps], np.float32),
        np.asarray([p.min_p for p in ps], np.float32),
        np.asarray(seeded, np.int64),
        np.asarray(seeds, np.int64),
    ]
