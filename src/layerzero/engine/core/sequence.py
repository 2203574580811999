"""``Sequence``: one completion's state as the scheduler and the engine see it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from ..sampling_params import SamplingParams

__all__ = ["FinishReason", "PromptLogprobs", "Sequence", "SequenceStatus"]

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    """WAITING (queued, or preempted and queued again), RUNNING (holds KV blocks), FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why generation ended: a stop condition (EOS, stop id, stop string), a length limit, an abort
    (``abort()``, a stream closed before the end, an interrupted ``generate``) or an error (the request failed
    inside a step; the request output's ``error`` says why)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class PromptLogprobs:
    """A request's prompt logprobs being collected (``SamplingParams.prompt_logprobs``), shared by its ``n``
    sequences: ``entries[j]`` is {token id: raw logprob} of the top ``top_n`` and prompt token j at position
    j (from the logits of position j - 1); ``entries[0]`` stays None. A step computes some positions of one
    sequence's chunk (:meth:`fill`); any sequence of the request may fill any entry (the first value
    stays). ``done`` once every entry is in; ``sent`` once the core sent them (with the request's first
    output)."""

    __slots__ = ("entries", "missing", "sent", "top_n")

    def __init__(self, top_n: int, num_prompt_tokens: int) -> None:
        self.top_n = top_n
        self.entries: list[dict[int, float] | None] = [None] * num_prompt_tokens
        self.missing = max(num_prompt_tokens - 1, 0)
        self.sent = False

    @property
    def done(self) -> bool:
        """Whether every prompt token after the first has its entry."""
        return self.missing == 0

    def fill(self, start: int, rows: list[dict[int, float]]) -> None:
        """The entries of prompt tokens ``start + 1 ..`` (``rows[i]``: from the logits of position
        ``start + i``); entries already in are kept."""
        e = self.entries
        for i, d in enumerate(rows, start + 1):
            if e[i] is None:
                e[i] = d
                self.missing -= 1


@dataclass(eq=False)
class Sequence:
    """One completion of a request (a request with ``n > 1`` has n sequences sharing the prompt).

    ``token_ids`` holds prompt then output tokens; ``num_computed_tokens`` of them have their KV in the cache
    (prefix-cache hits included). ``seed`` is the sequence's own random stream (None: the engine's stream).

    With async scheduling a sampled token can be *pending*: drawn on the device, its id not read by the host
    yet. ``pending_index`` is then its row in the in-flight step's sampled tokens (the next step's input id is
    gathered from there on the device), and it counts in :attr:`num_tokens` (so the scheduler schedules its
    decode) but is not in ``token_ids`` (so outputs, stop checks and the prefix cache only ever see known
    tokens). ``length_capped``: the pending token ends the sequence by length (max_tokens / max_model_len), so
    it is not scheduled again. ``first_scheduled_time``: ``time.monotonic()`` when it first left the waiting
    queue (its queue time is that minus ``arrival_time``, reported once: ``queue_time_sent``).

    Speculative decoding: ``spec_token_ids`` are the drafts the current step verifies after the last token
    (-1: a draft model's, proposed on the device), None when it decodes plainly; ``num_draft_tokens``,
    ``num_accepted_tokens`` and ``num_spec_steps`` count its verified drafts, the accepted ones and its
    verification steps.

    ``prompt_lp``: the request's :class:`PromptLogprobs` (shared by its sequences) when it asked for them,
    else None. While they are not ``done`` the sequence is admitted without prefix-cache hits (cached tokens
    have no logits) and its prompt chunks compute them.
    """

    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    seed: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    pending_index: int | None = None
    length_capped: bool = False
    prompt_lp: PromptLogprobs | None = None
    first_scheduled_time: float | None = None
    queue_time_sent: bool = False
    spec_token_ids: list[int] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    @property
    def num_pending(self) -> int:
        """Sampled tokens whose ids the host has not read yet (0 or 1; async scheduling)."""
        return 0 if self.pending_index is None else 1

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, a pending one included."""
        return len(self.token_ids) + (self.pending_index is not None)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated (a pending one included)."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (1 for a sequence in decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        """Whether generation ended."""
        return self.status is SequenceStatus.FINISHED
