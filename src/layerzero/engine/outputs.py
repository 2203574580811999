"""What ``LLM.generate`` / ``LLM.stream`` return (vLLM's ``RequestOutput`` and ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput", "SpecDecodeMetrics", "merge_deltas"]


@dataclass
class CompletionOutput:
    """One completion: ``text`` and ``token_ids`` (the whole output, or in a streamed delta only what is new
    since the last one), ``cumulative_logprob`` (sum of the chosen tokens' raw logprobs; 0.0 unless logprobs
    were requested), ``logprobs`` (per token: {token id: raw logprob} of the top-N and the chosen token; None
    unless requested), ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"`` (aborted: ``LLM.abort``, a
    stream left early, an interrupted call), ``"error"`` (failed inside a step; :attr:`RequestOutput.error`
    says why), or None while running) and ``stop_reason`` (the stop string or stop token id that ended it;
    None for EOS or length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """Whether this completion ended."""
        return self.finish_reason is not None


@dataclass
class SpecDecodeMetrics:
    """A request's speculative decoding so far, over its completions (vLLM's ``spec_decode`` names):
    ``num_drafts`` (verification steps: steps in which a completion verified at least one draft),
    ``num_draft_tokens`` (drafts verified), ``num_accepted_tokens`` (drafts accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified drafts (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 + accepted drafts / verification steps (vLLM's mean acceptance
        length; 0.0 before any step)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class RequestMetrics:
    """A request's times on the way to its first token (vLLM's ``RequestMetrics`` names), in
    ``time.monotonic()`` seconds (Linux's CLOCK_MONOTONIC: one clock for the front end's and the engine core's
    processes, so differences across them are meaningful; not wall time). ``arrival_time``: the front end
    took the request (tokenized, validated; just before it goes to the core); ``first_scheduled_time``: the
    core's first step of it started; ``time_in_queue``: seconds from the core receiving it to that step;
    ``first_token_time``: the core's step that produced its first token ended (with async scheduling,
    after the next step's launch); ``first_token_received_time``: the front end began handling that step's
    message. None until known. Where the time to first token goes (:meth:`ttft_breakdown`)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    time_in_queue: float | None = None
    first_token_time: float | None = None
    first_token_received_time: float | None = None

    def ttft_breakdown(self) -> dict[str, float] | None:
        """The time to first token split in milliseconds: ``to_core`` (the front end's send until the core
        received it), ``queue`` (received until its first step started), ``engine`` (that step's start until
        the first token's step ended: prefill, sampling, the read), ``to_front_end`` (the output
        message's trip and its wait for the front end's event loop); None before the first token."""
        s, q, t, r = (
            self.first_scheduled_time,
            self.time_in_queue,
            self.first_token_time,
            self.first_token_received_time,
        )
        if s is None or q is None or t is None or r is None:
            return None
        ms = {"to_core": s - q - self.arrival_time, "queue": q, "engine": t - s, "to_front_end": r - t}
        return {k: round(1e3 * v, 3) for k, v in ms.items()}


@dataclass
class RequestOutput:
    """One request: its prompt (text, or None when given as token ids), prompt token ids, one
    :class:`CompletionOutput` per sample (``SamplingParams.n``), ``finished`` once all ended, and
    ``num_cached_tokens`` (prompt tokens served from the prefix cache); ``error``: why the request failed (its
    completions then end with ``finish_reason="error"``), else None; ``prompt_logprobs``: with
    ``SamplingParams.prompt_logprobs``, one entry per prompt token ({token id: raw logprob} of the top-N and
    the prompt token itself; the first token's entry None), shared by the ``n`` completions; in a stream only
    the first delta has it (None elsewhere, and when not asked for); ``queue_time``: seconds the request
    waited in the engine core's queue before its first step (vLLM's ``time_in_queue``; the server's
    ``request_queue_time_seconds``), set from its first output on (in a stream: the first delta only), None
    before it was scheduled; ``spec_decode_metrics``: with speculative decoding on, its
    :class:`SpecDecodeMetrics` so far (None when off); ``metrics``: the request's :class:`RequestMetrics`
    (None from engines that do not time it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    queue_time: float | None = None
    spec_decode_metrics: SpecDecodeMetrics | None = None
    metrics: RequestMetrics | None = None


def merge_deltas(outs: list[RequestOutput]) -> RequestOutput:
    """One delta of consecutive deltas of a request (texts, token ids and logprobs concatenated per
    completion; ``prompt_logprobs`` and ``queue_time`` from the first that has them; the rest from the
    last)."""
    last = outs[-1]
    comps = []
    for i, c in enumerate(last.outputs):
        parts = [o.outputs[i] for o in outs]
        lps = None if c.logprobs is None else [x for p in parts for x in (p.logprobs or ())]
        comps.append(
            CompletionOutput(
                c.index,
                "".join(p.text for p in parts),
                [t for p in parts for t in p.token_ids],
                c.cumulative_logprob,
                lps,
                c.finish_reason,
                c.stop_reason,
            )
        )
    return RequestOutput(
        last.request_id,
        last.prompt,
        last.prompt_token_ids,
        comps,
        last.finished,
        last.num_cached_tokens,
        last.error,
        next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
        next((o.queue_time for o in outs if o.queue_time is not None), None),
        last.spec_decode_metrics,
        last.metrics,
    )
