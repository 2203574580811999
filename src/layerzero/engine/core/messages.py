"""What crosses between the front end and the engine core: plain data only (ints, floats, strings, lists,
dicts and :class:`~layerzero.engine.SamplingParams`), so a message can go to another process as msgpack
unchanged (vLLM V1's ``EngineCoreRequest`` / ``EngineCoreOutput(s)``; never pickle).

The front end tokenizes and validates (``EngineCoreRequest``), the core schedules and samples and sends back
token ids (``EngineCoreOutput``: only what is new since its last output for that completion); the front end
detokenizes, applies stop strings (then tells the core to stop that completion: :class:`EngineCoreAbort`)
and builds :class:`~layerzero.engine.RequestOutput` deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..sampling_params import SamplingParams

__all__ = [
    "EngineCoreAbort",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreProtocol",
    "EngineCoreRequest",
    "SchedulerStats",
]


@dataclass
class EngineCoreRequest:
    """One validated, tokenized request: ``prompt_token_ids`` (tokens), its :class:`SamplingParams` (``n``
    completions; stop strings are the front end's), ``priority`` (lower runs first under the priority policy),
    ``arrival_time`` (``time.time()`` seconds in the front end: comparable across processes) and
    ``eos_token_id`` (the front end's tokenizer's EOS, a stop token besides the model's; None: none)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    eos_token_id: int | None = None


@dataclass
class EngineCoreAbort:
    """End completions early: every completion of ``request_id`` (``index`` None) or one; ``reason``
    ``"abort"`` (the client left, ``abort()``) or ``"stop"`` (the front end found a stop string;
    ``stop_reason`` is that string). Unknown or finished ids are ignored."""

    request_id: str
    index: int | None = None
    reason: str = "abort"
    stop_reason: str | None = None


@dataclass
class EngineCoreOutput:
    """What one step added to one completion (``index`` < ``n``) of a request: ``new_token_ids`` (zero or
    more tokens: more than one once speculative decoding lands), per new token ``new_logprobs`` ({token id:
    raw logprob} of the top-N and the chosen token; None unless ``SamplingParams.logprobs``),
    ``cumulative_logprob`` (the running sum of the chosen tokens' logprobs), ``prompt_logprobs`` (sent once,
    with the first output: one entry per prompt token, the first None; None unless asked for),
    ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None while running),
    ``stop_reason`` (the stop token id, or None), ``num_cached_tokens`` (prompt tokens served from the
    prefix cache), ``error`` (why the request failed, with ``finish_reason="error"``) and ``queue_time``
    (seconds from the core receiving the request to its first step) with ``scheduled_time`` (that first
    step's start, ``time.monotonic()`` seconds: Linux's one monotonic clock for every process of the host;
    both sent once, with the first output);
    ``spec_decode`` (speculative decoding on: the completion's ``[verification steps, draft tokens, accepted
    drafts]`` so far; None when off)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    queue_time: float | None = None
    spec_decode: list[int] | None = None
    scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        """Whether this completion ended with this output."""
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """The core's state after a step, for metrics (vLLM's names): requests running / waiting, KV cache usage
    (fraction of blocks held, 0..1), and counters since start: prefix-cache queries and hits (tokens),
    preemptions, prompt and generation tokens; with speculative decoding, vLLM's ``spec_decode`` counters
    (verification rows, draft tokens, accepted drafts, and accepted drafts per draft position)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass
class EngineCoreOutputs:
    """One step's outputs, ``timestamp`` (``time.monotonic()`` seconds when the step's outputs were ready: one
    clock for every process of the host, so the front end can time the message's trip) and the core's
    stats."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0
    stats: SchedulerStats | None = None


class EngineCoreProtocol(Protocol):
    """What the front end needs from an engine core, in-process or behind a process boundary."""

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (validated by the front end). Raises ``InvalidInputError`` for a duplicate id."""

    def abort_requests(self, aborts: list[EngineCoreAbort]) -> None:
        """End completions early; their KV blocks are free after the next step at the latest."""

    def step(self) -> EngineCoreOutputs:
        """Run one step (schedule -> execute -> update) and return what it produced."""

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued or running."""

    def shutdown(self) -> None:
        """Release the model and the KV cache."""
