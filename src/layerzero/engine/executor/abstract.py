"""The ``Executor`` protocol: what the engine core needs to run a step (vLLM V1's ``Executor``)."""

from __future__ import annotations

from typing import Protocol

from ..core.sched.output import SchedulerOutput
from ..worker.worker import ModelRunnerOutput

__all__ = ["Executor"]


class Executor(Protocol):
    """Runs steps on the model's workers. ``num_kv_blocks``: KV blocks each worker's pool holds (the core's
    KV manager hands out exactly these); ``cascade_steps`` / ``cascade_saved_tokens``: cascade-attention
    counters (metrics)."""

    num_kv_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Launch one step (forward and draw) without waiting for its tokens
        (:meth:`ModelRunnerOutput.get_output` does). Raises ``SamplingError`` when the draw raised."""

    def reset(self) -> None:
        """Forget any launched step's tokens (the core rolled a failed step back)."""

    def shutdown(self) -> None:
        """Release the workers (model, KV pools, graphs)."""

    @property
    def cascade_steps(self) -> int:
        """Steps run as cascade attention."""

    @property
    def cascade_saved_tokens(self) -> int:
        """KV tokens (per layer) the cascade steps' shared level did not read again."""
