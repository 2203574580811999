"""``Worker``: one device's model runner and sampler; runs a step given as plain data
(:class:`~layerzero.engine.core.sched.output.SchedulerOutput`) and hands back its sampled tokens
(:class:`ModelRunnerOutput`). The executor drives it (in-process now; one per GPU with tensor parallelism)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig, ModelConfig
from ..core.sched.output import SchedulerOutput
from ..logits_processors import BatchState, build_processors
from ..parallel.state import SINGLE, ParallelState
from .model_runner import ModelRunner
from .prompt_logprobs import PendingPromptLogprobs, launch_prompt_logprobs
from .sampler import PendingSample, Sampler, SamplerOutput, plain_greedy
from .warmup import WarmupReport, maybe_warm_up

__all__ = ["ModelRunnerOutput", "Worker"]


@dataclass(eq=False)
class ModelRunnerOutput:
    """A launched step's sampled tokens, on their way to the host (vLLM's ``AsyncModelRunnerOutput``):
    ``pending`` (the draw in flight), ``num_rows`` (the step's sampled rows, in chunk order) and ``prompt``
    (the step's prompt logprobs in flight, or None). :meth:`get_output` waits for them."""

    pending: PendingSample
    num_rows: int
    prompt: PendingPromptLogprobs | None = None

    def get_output(self) -> SamplerOutput:
        """Wait for the tokens and read them (per row: a list of new token ids, logprobs when asked; per
        prompt-logprob chunk of the step its entries: ``SamplerOutput.prompt_logprobs``)."""
        res = Sampler.resolve(self.pending)
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
        self.runner = ModelRunner(cfg, ec, device, dtype, max_model_len, max_num_batched_tokens, parallel)
        self.sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, device, ec.seed)
        self.prev_tokens: torch.Tensor | None = None
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
        self.sampler.penalties.release([*out.preempted_seq_ids, *rows.free_seq_ids])
        lp = self.logitsprocs
        if lp is not None:  # tell the plugins this step's rows (its sampled chunks, in order)
            lp.update([s for s, x in zip(out.seq_ids, out.sample, strict=True) if x], rows)
        prev = self.prev_tokens if any(s is not None for s in out.pending_src) else None
        greedy = plain_greedy(rows) and (lp is None or lp.argmax_invariant)
        res = self.runner.execute(out, prev, greedy=greedy)
        prompt = None
        if res.prompt_hidden is not None:
            prompt = launch_prompt_logprobs(
                res.prompt_hidden,
                self.runner.model.compute_logits,
                self.sampler.vocab_size,
                out.prompt_logprobs,
            )
        pending = res.pending if res.pending is not None else self.sampler.launch(res.logits, rows)
        self.prev_tokens = pending.tokens
        return ModelRunnerOutput(pending, len(rows), prompt)

    def reset(self) -> None:
        """Forget the last step's sampled ids (a failed step was rolled back: nothing is pending)."""
        self.prev_tokens = None
