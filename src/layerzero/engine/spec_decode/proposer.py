"""Device-side drafts (:class:`DraftProposer`): ``"draft_model"`` (a second small model with its own KV pool,
addressed by the target's block tables and slots, so no second block manager) and ``"layer_skip"`` (the
target's first m layers, its final norm and LM head; their KV is the target's, which the verification forward
rewrites). Drafts are greedy (the draft's argmax: q is one-hot in the verification)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

import layerzero as lz

from ..config import EngineConfig, ModelConfig
from ..core.sched.output import SchedulerOutput
from ..loader import load_dummy_weights, load_model_weights
from ..models.registry import build_model
from ..worker.attn_metadata import ForwardBatch
from ..worker.input_batch import ScheduledChunk, build_forward_batch
from .config import SpeculativeConfig

__all__ = ["DraftProposer"]

log = logging.getLogger("layerzero.engine")


class DraftProposer:
    """Proposes a draft model's (or the target's first layers') drafts for a verification step.

    ``runner``: the target's :class:`~layerzero.engine.worker.model_runner.ModelRunner` (its model, KV pools,
    block size). For ``"draft_model"`` the draft is loaded from ``spec.model`` (``ec.load_format="dummy"``:
    seeded random weights with the engine's seed, so a draft with the target's config equals the target) in
    the target's dtype, with one KV pool per draft layer of ``runner.num_blocks`` blocks: the draft's KV of a
    token lives at the target's slot of that token. The draft's pool mirrors every target forward
    (:meth:`mirror`: prefill chunks, decode and verification steps), so a block the prefix cache shares holds
    the draft's KV of its tokens too.

    Raises:
        ConfigurationError: the draft's config is unreadable or unsupported, its vocabulary differs from the
            target's, ``num_layers`` out of range (``SpeculativeConfig.check_model``)."""

    def __init__(self, spec: SpeculativeConfig, runner: Any, ec: EngineConfig, max_model_len: int) -> None:
        self.spec, self.runner = spec, runner
        tcfg = runner.cfg
        self.model: Any = runner.model
        self.kv: list[torch.Tensor] = runner.kv_caches
        self.num_layers = tcfg.num_layers
        if spec.method == "layer_skip":
            spec.check_model(tcfg.num_layers, tcfg.vocab_size)
            self.num_layers = spec.num_layers
        else:
            dcfg = ModelConfig.from_pretrained(spec.model)
            spec.check_model(tcfg.num_layers, tcfg.vocab_size, dcfg.vocab_size)
            self.model = build_model(dcfg, max_model_len, runner.device, runner.dtype)
            if ec.load_format == "dummy":
                load_dummy_weights(self.model, ec.seed)
            else:
                load_model_weights(self.model, spec.model)
            hkv = getattr(self.model, "num_local_kv_heads", dcfg.num_kv_heads)
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
            self.num_layers = dcfg.num_layers
            log.info(
                "draft model %s: %d layers, KV pool %d blocks", spec.model, dcfg.num_layers, runner.num_blocks
            )

    @property
    def mirrors(self) -> bool:
        """Whether the draft has its own KV pool that every target forward must also fill."""
        return self.spec.method == "draft_model"

    @torch.no_grad()
    def mirror(self, batch: ForwardBatch) -> None:
        """Run the draft over a target step's batch (the same ids, positions and slots): its KV pool then
        holds the draft's KV of every token the target computed (rejected drafts' positions included,
        overwritten later as the target's are)."""
        self._logits(batch, logits=False)

    def _logits(self, batch: ForwardBatch, logits: bool = True) -> torch.Tensor | None:
        m = self.model
        x, residual = m.embed_tokens(batch.input_ids), None
        for layer, cache in zip(m.layers[: self.num_layers], self.kv[: self.num_layers], strict=True):
            x, residual = layer(x, residual, batch, cache)
        if not logits:
            return None
        return m.compute_logits(m.norm(x, residual)[0])

    @torch.no_grad()
    def propose(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy drafts for the speculating chunks of ``out`` (``spec_token_ids`` of -1s; their last token
        known, at position ``num_computed_tokens``): k draft decode steps, step j feeding position P + j the
        previous step's argmax (the last token at j = 0) and writing the draft's KV there (slots the scheduler
        allocated for the verification chunk). Returns ``(drafts, rows, ids)``: ``drafts`` ``[R, K]`` int64 on
        the device, one row per speculating chunk in order (entries past a row's count 0), and the
        verification batch's input rows ``[D]`` / ids ``[D]`` where they go (``ModelRunner.execute``'s
        ``spec_inputs``)."""
        dev, bs = self.runner.device, self.runner.block_size
        chunks = [i for i, d in enumerate(out.spec_token_ids) if d]
        counts = [len(out.spec_token_ids[i]) for i in chunks]
        starts = [out.num_computed_tokens[i] for i in chunks]
        k = max(counts)
        tables = out.block_tables[chunks]
        drafts = torch.zeros(len(chunks), k, dtype=torch.int64, device=dev)
        last = torch.as_tensor([out.new_token_ids[i][0] for i in chunks], dtype=torch.int64).to(dev)
        for j in range(k):
            act = [r for r, c in enumerate(counts) if c > j]
            sched = [ScheduledChunk([0], starts[r] + j, 1, (), True, None, starts[r] + j) for r in act]
            batch = build_forward_batch(sched, bs, dev, None, None, np.ascontiguousarray(tables[act]))
            if j == 0:
                ids = last
            else:
                ids = drafts[torch.as_tensor(act, dtype=torch.int64).to(dev), j - 1]
            batch.input_ids.copy_(ids)
            tok = self._logits(batch).argmax(dim=-1)
            drafts[torch.as_tensor(act, dtype=torch.int64).to(dev), j] = tok
        # where the drafts go in the verification batch: chunk i's rows cu[i] + 1 .. cu[i] + count
        cu = np.concatenate([[0], np.cumsum(out.num_scheduled_tokens)])
        rows = np.concatenate(
            [np.arange(cu[i] + 1, cu[i] + 1 + c) for i, c in zip(chunks, counts, strict=True)]
        )
        take = np.concatenate([np.arange(c) + r * k for r, c in enumerate(counts)])
        rows_t, take_t = (torch.as_tensor(a, dtype=torch.int64).to(dev) for a in (rows, take))
        return drafts, rows_t, drafts.reshape(-1).index_select(0, take_t)
