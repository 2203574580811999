"""``Worker``: one device's model runner and sampler; runs a step given as plain data
(:class:`~layerzero.engine.core.sched.output.SchedulerOutput`) and hands back its sampled tokens
(:class:`ModelRunnerOutput`). The executor drives it (in-process now; one per GPU with tensor parallelism)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from ..core.sched.output import SchedulerOutput
from ..logits_processors import BatchState, build_processors
from ..parallel.state import SINGLE, ParallelState
from ..spec_decode.proposer import DraftProposer, load_draft
from ..spec_decode.verify import verify_step
from .model_runner import ModelRunner
from .prompt_logprobs import PendingPromptLogprobs, launch_prompt_logprobs
from .sampler import PendingSample, Sampler, SamplerOutput, plain_greedy
from .staging import to_device
from .warmup import WarmupReport, maybe_warm_up

__all__ = ["ModelRunnerOutput", "Worker"]

log = logging.getLogger("layerzero.engine")


@dataclass(eq=False)
class ModelRunnerOutput:
    """A launched step's sampled tokens, on their way to the host (vLLM's ``AsyncModelRunnerOutput``):
    ``pending`` (the draw in flight), ``num_rows`` (the step's sampled rows, in chunk order) and ``prompt``
    (the step's prompt logprobs in flight, or None). :meth:`get_output` waits for them."""

    pending: PendingSample | None
    num_rows: int
    prompt: PendingPromptLogprobs | None = None
    done: SamplerOutput | None = None

    def get_output(self) -> SamplerOutput:
        """Wait for the tokens and read them (per row: a list of new token ids, logprobs when asked; per
        prompt-logprob chunk of the step its entries: ``SamplerOutput.prompt_logprobs``). A verification step
        (speculative decoding) was read already: ``done``."""
        res = self.done if self.done is not None else Sampler.resolve(self.pending)
        if self.prompt is not None:
            res.prompt_logprobs = self.prompt.resolve()
        return res


class Worker:
    """The model on one device: :class:`ModelRunner` (weights, KV pools, CUDA graphs) and :class:`Sampler`.
    Keeps the last step's sampled ids on the device (``prev_tokens``): the next step's pending inputs are
    gathered from them (``SchedulerOutput.pending_src``), never copied through the host. ``parallel``: this
    rank's :class:`ParallelState` (every tensor-parallel rank has a worker running the same steps; each
    samples with the same seed from the same full logits, so all ranks draw the same tokens)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ec: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_batched_tokens: int,
        parallel: ParallelState = SINGLE,
    ) -> None:
        self.device = device
        self.parallel = parallel
        spec = ec.speculative_config
        draft, draft_bytes = load_draft(spec, ec, cfg, device, dtype, max_model_len)  # before the KV pool
        self.runner = ModelRunner(
            cfg,
            ec,
            device,
            dtype,
            max_model_len,
            max_num_batched_tokens,
            parallel,
            extra_kv_bytes_per_block=draft_bytes,
        )
        self.sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, device, ec.seed)
        self.prev_tokens: torch.Tensor | None = None
        #: Speculative decoding's device-side drafts (draft model / layer skip), or None (off, or n-gram).
        self.drafter: DraftProposer | None = None
        if spec is not None and spec.method != "ngram":
            self.drafter = DraftProposer(spec, self.runner, ec, max_model_len, draft)
        self._eager_logged = False
        #: Start-up warm-up (``EngineConfig.warmup``; :mod:`.warmup`): what it ran, or None when off.
        self.warmup: WarmupReport | None = maybe_warm_up(
            ec, self.runner, self.sampler, max_num_batched_tokens
        )
        #: Logits-processor plugins (``EngineConfig.logits_processors``), built after the warm-up (which
        #: samples dummy rows they are not told about); None without any.
        procs = build_processors(ec, device)
        self.logitsprocs: BatchState | None = BatchState(procs) if procs else None
        self.sampler.logitsprocs = self.logitsprocs

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward ``out`` and launch its draw (a plain greedy step may take the ids its greedy decode graph
        sampled); returns without waiting for the tokens.

        Raises:
            SamplingError: the draw raised (its ``rows`` name the rows that raise alone).
        """
        rows = out.sampling
        if out.blocks_to_copy:  # copy-on-write forks (beam search): their partial blocks, before the forward
            d = self.drafter
            extra = d.kv if d is not None and d.kv is not self.runner.kv_caches else []
            self.runner.copy_blocks(out.blocks_to_copy, extra)
        self.sampler.penalties.release([*out.preempted_seq_ids, *rows.free_seq_ids])
        lp = self.logitsprocs
        if lp is not None:  # tell the plugins this step's rows (its sampled chunks, in order)
            lp.update([s for s, x in zip(out.seq_ids, out.sample, strict=True) if x], rows)
        prev = self.prev_tokens if any(s is not None for s in out.pending_src) else None
        if any(out.spec_token_ids):
            return self._verify(out, prev)
        greedy = plain_greedy(rows) and (lp is None or lp.argmax_invariant)
        res = self.runner.execute(out, prev, greedy=greedy)
        prompt = self._after_forward(res, out)
        pending = res.pending if res.pending is not None else self.sampler.launch(res.logits, rows)
        self.prev_tokens = pending.tokens
        return ModelRunnerOutput(pending, len(rows), prompt)

    def _after_forward(self, res: Any, out: SchedulerOutput) -> PendingPromptLogprobs | None:
        """What every forward is followed by: the draft model mirrors the step (its KV pool in step with the
        target's), and the step's prompt logprobs are launched (None when it has none)."""
        if self.drafter is not None and self.drafter.mirrors:
            self.drafter.mirror(self.runner.last_batch)
        if res.prompt_hidden is None:
            return None
        return launch_prompt_logprobs(
            res.prompt_hidden, self.runner.model.compute_logits, self.sampler.vocab_size, out.prompt_logprobs
        )

    def _verify(self, out: SchedulerOutput, prev: torch.Tensor | None) -> ModelRunnerOutput:
        """A verification step (speculative decoding; read at once): device drafts proposed first when the
        step has a draft model's, one forward with ``1 + drafts`` logits rows per speculating chunk (a decode
        CUDA graph of one row per verified position when it fits: ``ModelRunner.verify_as_decode``), then
        :func:`~layerzero.engine.spec_decode.verify.verify_step` (plain rows sampled as usual); a greedy
        one queues the next round's first draft step before it is read (``DraftProposer.ahead_hook``)."""
        drafts = spec_inputs = q = None
        if self.drafter is not None:
            drafts, rows_t, ids_t, q = self.drafter.propose(out, self.sampler.generator)
            spec_inputs = (rows_t, ids_t)
        res = self.runner.execute(out, prev, greedy=False, spec_inputs=spec_inputs)
        if self.device.type == "cuda" and not self._eager_logged and not self.runner.last_batch.is_decode:
            self._eager_logged = True
            log.info(
                "speculative decoding: a verification step with prefill chunks (or more verified positions "
                "than the largest decode CUDA graph) runs eager; pure decode ones replay the decode graphs"
            )
        prompt = self._after_forward(res, out)
        ahead = None if self.drafter is None else self.drafter.ahead_hook(out)
        done = verify_step(res.logits, out, self.sampler, drafts, q, before_read=ahead)
        if ahead is not None:
            self.drafter.settle([len(t) - 1 for t in done.sampled_token_ids])
        last = [t[-1] for t in done.sampled_token_ids]
        (self.prev_tokens,) = to_device([np.asarray(last, dtype=np.int64)], self.device)
        return ModelRunnerOutput(None, len(last), prompt, done)

    def reset(self) -> None:
        """Forget the last step's sampled ids and a launched first draft step (a failed step was rolled
        back: nothing is pending)."""
        self.prev_tokens = None
        if self.drafter is not None:
            self.drafter.drop_ahead()
