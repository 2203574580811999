"""``InProcessExecutor``: one :class:`~layerzero.engine.worker.worker.Worker` in the engine core's own process
and thread (a step is a method call; the scheduler output is not copied)."""

from __future__ import annotations

import torch

from ..config import EngineConfig, ModelConfig
from ..core.sched.output import SchedulerOutput
from ..worker.model_runner import ModelRunner
from ..worker.warmup import WarmupReport
from ..worker.worker import ModelRunnerOutput, Worker

__all__ = ["InProcessExecutor"]


class InProcessExecutor:
    """The :class:`~.abstract.Executor` of one device in this process: builds the worker (loads the model,
    sizes and allocates the KV pools, captures CUDA graphs).

    Raises:
        ConfigurationError: what :class:`~layerzero.engine.worker.model_runner.ModelRunner` raises.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ec: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.worker: Worker | None = Worker(cfg, ec, device, dtype, max_model_len, max_num_batched_tokens)
        self.num_kv_blocks = self.worker.runner.num_blocks

    @property
    def runner(self) -> ModelRunner:
        """The worker's model runner (tests and benchmarks reach the model and its graphs through it)."""
        return self.worker.runner

    @property
    def warmup(self) -> WarmupReport | None:
        """The worker's start-up warm-up (:class:`~layerzero.engine.worker.warmup.WarmupReport`), None when
        off."""
        return self.worker.warmup if self.worker is not None else None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def reset(self) -> None:
        self.worker.reset()

    def shutdown(self) -> None:
        self.worker = None

    @property
    def cascade_steps(self) -> int:
        return self.worker.runner.cascade_steps

    @property
    def cascade_saved_tokens(self) -> int:
        return self.worker.runner.cascade_saved_tokens
