"""``ParallelState``: which shard of the model this process holds (vLLM's ``parallel_state``, passed
explicitly instead of read from module globals). Built by the worker after ``torch.distributed`` is
initialised; handed to the model, its layers and the loader. The default is one rank: no collective runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SINGLE", "ParallelState"]


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the engine's ranks.

    ``tp_rank`` / ``tp_size``: tensor-parallel rank and group size (attention heads, the MLP's intermediate
    size and the vocabulary are split ``tp_size`` ways). ``ep``: experts are split across the TP ranks
    instead of their intermediate size (``enable_expert_parallel``; vLLM's semantics: EP size = TP size).
    ``group``: the ``torch.distributed`` process group of the TP ranks (None: the default group, or no
    group at all when ``tp_size == 1``).
    """

    tp_rank: int = 0
    tp_size: int = 1
    ep: bool = False
    group: Any = None

    @property
    def is_parallel(self) -> bool:
        """True when more than one rank holds the model (collectives run)."""
        return self.tp_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank whose sampled tokens the engine core reads."""
        return self.tp_rank == 0


SINGLE = ParallelState()
"""One rank holding the whole model."""
