"""The engine core's per-request state: :class:`Request` (a request's ``n`` sequences) and :class:`InFlight`
(a launched step whose sampled ids are still on their way to the host).

Plain data shared by the step loop (``llm_engine.py``) and its failure recovery (``recovery.py``), so neither
imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .sequence import Sequence

__all__ = ["InFlight", "Request"]


@dataclass(eq=False)
class Request:
    """A request in the core: its id, its ``n`` sequences (completions), and ``error`` (why it failed: its
    sequences then end with ``"error"``). The prompt's text, the output text and what a stream has shown are
    the front end's."""

    request_id: str
    seqs: list[Sequence]
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Whether every sequence ended."""
        return all(s.finished for s in self.seqs)


@dataclass(eq=False)
class InFlight:
    """A launched step whose sampled ids are still on their way to the host (async scheduling): the sequences
    it sampled, in row order, the executor's result (``ModelRunnerOutput``: ``get_output()`` waits for the
    ids) and the chunks whose prompt logprobs it computes ((sequence, first position), in the order of the
    result's ``prompt_logprobs``; usually none)."""

    sampled: list[Sequence]
    result: Any
    prompt_logprobs: list[tuple[Sequence, int]] = field(default_factory=list)
