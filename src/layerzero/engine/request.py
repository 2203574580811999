"""The engine's per-request state: :class:`Request` (a request's prompt and sequences, and its outbox) and
:class:`InFlight` (a launched step whose sampled ids are still on their way to the host).

Plain data shared by the step loop (``engine.py``) and its failure recovery (``recovery.py``), so neither
imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass

from .sampler import PendingSample
from .sequence import Sequence

__all__ = ["InFlight", "Request"]


@dataclass(eq=False)
class Request:
    """A request: its prompt and its ``n`` sequences; ``sent_tokens`` counts, per sequence, the output tokens
    a stream has already yielded; ``error``: why it failed (its sequences then end with ``"error"``).

    The object is the request's outbox: whoever runs a step, the tokens land in its sequences, and its owner
    (``generate`` / ``stream`` / a server) reads them from here (:meth:`LLMEngine.output
    <layerzero.engine.engine.LLMEngine.output>`), never from another caller's step results."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    sent_tokens: list[int]
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Whether every sequence ended."""
        return all(s.finished for s in self.seqs)


@dataclass(eq=False)
class InFlight:
    """A launched step whose sampled ids are still on their way to the host (async scheduling): the sequences
    it sampled, in row order, and the draw."""

    sampled: list[Sequence]
    pending: PendingSample
