"""Output processing (vLLM V1's ``OutputProcessor``): the engine core's token ids
(:class:`~layerzero.engine.core.messages.EngineCoreOutput`) become :class:`~layerzero.engine.RequestOutput`
s: incremental detokenization, stop strings (checked after ``min_tokens``; the core is then told to stop the
completion: :class:`~layerzero.engine.core.messages.EngineCoreAbort`), streaming deltas that never show text
which may still become a stop string, logprobs accumulated per completion, and the request's prompt logprobs
(sent once by the core, with its first output; every output has them, a stream's first delta only)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.messages import EngineCoreAbort, EngineCoreOutput
from ..errors import bad_input
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeMetrics
from ..sampling_params import SamplingParams
from .detokenizer import Detokenizer

__all__ = ["OUTPUT_KINDS", "OutputKind", "OutputProcessor", "ProcessedOutputs"]

log = logging.getLogger("layerzero.engine")

OutputKind = Literal["cumulative", "delta", "final_only"]
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class ProcessedOutputs:
    """What one batch of core outputs gave: ``request_outputs`` (one per request with news, as its
    ``output_kind`` asks) and ``aborts`` (completions a stop string ended: the core must stop them)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    aborts: list[EngineCoreAbort] = field(default_factory=list)


class _Completion:
    """One completion's front-end state: its tokens, text, logprobs, end, and what deltas have shown."""

    __slots__ = (
        "cum_lp",
        "detok",
        "finish_reason",
        "index",
        "logprobs",
        "sent",
        "spec",
        "stop_reason",
        "token_ids",
    )

    def __init__(self, index: int, detok: Detokenizer | None, want_lp: bool) -> None:
        self.index, self.detok = index, detok
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if want_lp else None
        self.cum_lp = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sent = 0  # tokens a delta has returned
        self.spec: list[int] | None = None  # [verification steps, drafts, accepted] (speculative decoding)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Request:
    """One request's front-end state (the request's outbox until its final output is returned)."""

    __slots__ = (
        "comps",
        "error",
        "kind",
        "metrics",
        "num_cached",
        "params",
        "plp_sent",
        "prompt",
        "prompt_logprobs",
        "prompt_token_ids",
        "queue_time_sent",
        "request_id",
    )

    def __init__(
        self, rid: str, prompt: str | None, ids: list[int], params: SamplingParams, kind: str, tok: Any
    ) -> None:
        self.request_id, self.prompt, self.prompt_token_ids, self.params, self.kind = (
            rid,
            prompt,
            ids,
            params,
            kind,
        )
        want_lp = params.logprobs is not None
        self.comps = [
            _Completion(
                i,
                Detokenizer(tok, ids, params.stop_strings, params.skip_special_tokens)
                if tok is not None
                else None,
                want_lp,
            )
            for i in range(params.n)
        ]
        self.num_cached = 0
        self.error: str | None = None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # the core sends them once
        self.plp_sent = False  # a delta has returned them
        self.queue_time_sent = False
        # its times; time_in_queue (RequestOutput.queue_time) comes once, with the first output
        self.metrics = RequestMetrics(time.monotonic())

    @property
    def finished(self) -> bool:
        comps = self.comps  # n == 1 without a generator: this runs twice per request per step
        if len(comps) == 1:
            return comps[0].finish_reason is not None
        return all(c.finished for c in comps)


class OutputProcessor:
    """Turns core outputs into request outputs for the requests added to it. ``tokenizer``: the checkpoint's
    (None: no text, no stop strings). Not thread-safe: its owner serializes calls (``LLM`` holds a lock)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        output_kind: OutputKind = "cumulative",
    ) -> None:
        """Track a request (before its :class:`EngineCoreRequest` goes to the core). ``output_kind``:
        ``"cumulative"`` (each output holds everything so far), ``"delta"`` (only what is new since the last
        output; text that may become a stop string is held back) or ``"final_only"`` (one output, when it
        ends).

        Raises:
            InvalidInputError: an id tracked already; an unknown ``output_kind``.
        """
        if request_id in self.requests:
            raise bad_input("request_id", "a new id", repr(request_id))
        if output_kind not in OUTPUT_KINDS:
            raise bad_input("output_kind", f"one of {OUTPUT_KINDS}", repr(output_kind))
        self.requests[request_id] = _Request(
            request_id, prompt, list(prompt_token_ids), params, output_kind, self.tokenizer
        )

    def has_unfinished_requests(self) -> bool:
        """Whether any tracked request has not returned its final output."""
        return bool(self.requests)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a tracked request locally (its unfinished completions with ``"abort"``) and return its final
        output (as its ``output_kind`` asks); None when it is not tracked. The caller tells the core."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for c in req.comps:
            if not c.finished:
                c.finish_reason = "abort"
        return self._output(req)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], timestamp: float | None = None
    ) -> ProcessedOutputs:
        """Apply one step's core outputs (outputs of requests not tracked, of completion indexes the request
        does not have, or of completions that ended already, are ignored). ``timestamp``: the step's
        :attr:`EngineCoreOutputs.timestamp` (``time.monotonic()`` seconds; None: now), for
        :class:`RequestMetrics`."""
        res = ProcessedOutputs()
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for o in outputs:
            req = self.requests.get(o.request_id)
            if req is None or not 0 <= o.index < len(req.comps):
                continue
            if o.prompt_logprobs is not None and req.prompt_logprobs is None:
                req.prompt_logprobs = o.prompt_logprobs
            if o.queue_time is not None and req.metrics.time_in_queue is None:
                req.metrics.time_in_queue = o.queue_time
                req.metrics.first_scheduled_time = o.scheduled_time
            if o.new_token_ids and req.metrics.first_token_received_time is None:
                req.metrics.first_token_time = now if timestamp is None else timestamp
                req.metrics.first_token_received_time = now
            c = req.comps[o.index]
            if c.finished:
                continue
            touched[o.request_id] = req
            if o.num_cached_tokens > req.num_cached:
                req.num_cached = o.num_cached_tokens
            try:
                hit = self._add_tokens(req, c, o)
            except Exception as exc:  # e.g. the tokenizer cannot decode a token: this request fails alone
                log.error("request %s failed in output processing: %s", o.request_id, exc, exc_info=exc)
                req.error = f"{type(exc).__name__}: {exc}"
                for other in req.comps:
                    if not other.finished:
                        other.finish_reason = "error"
                res.aborts.append(EngineCoreAbort(o.request_id))
                continue
            if hit is not None:
                c.finish_reason, c.stop_reason = "stop", hit
                if not o.finished:
                    res.aborts.append(EngineCoreAbort(o.request_id, o.index, "stop", hit))
            elif o.finished:
                c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
                if o.error is not None:
                    req.error = o.error
        for req in touched.values():
            if req.kind != "final_only" or req.finished:
                res.request_outputs.append(self._output(req))
        return res

    def _add_tokens(self, req: _Request, c: _Completion, o: EngineCoreOutput) -> str | None:
        """Append ``o``'s tokens to ``c`` up to a stop string (returned, else None). A completion the core
        stopped by a token (EOS, a stop id) does not add that token's text."""
        toks = o.new_token_ids
        c.cum_lp = o.cumulative_logprob
        if o.spec_decode is not None:
            c.spec = o.spec_decode
        if not toks:
            return None
        p, d = req.params, c.detok
        last = len(toks) - 1
        for k, tok in enumerate(toks):
            c.token_ids.append(tok)
            if c.logprobs is not None and o.new_logprobs is not None:
                c.logprobs.append(o.new_logprobs[k])
            if d is None or (k == last and o.finish_reason == "stop"):
                continue
            hit = d.add(tok, len(c.token_ids) >= p.min_tokens)
            if hit is not None:
                return hit
        return None

    def _output(self, req: _Request) -> RequestOutput:
        """``req``'s output as its kind asks; a finished request is forgotten."""
        delta = req.kind == "delta"
        finished = req.finished
        outs = []
        for c in req.comps:
            start = c.sent if delta else 0
            d = c.detok
            text = "" if d is None else (d.delta(c.finished) if delta else d.text)
            lps = None if c.logprobs is None else c.logprobs[start:]
            outs.append(
                CompletionOutput(
                    c.index, text, c.token_ids[start:], c.cum_lp, lps, c.finish_reason, c.stop_reason
                )
            )
            if delta:
                c.sent = len(c.token_ids)
        if finished:
            self.requests.pop(req.request_id, None)
        plp = req.prompt_logprobs
        if delta and plp is not None:  # a stream returns them once, in the first delta that can
            plp = None if req.plp_sent else plp
            req.plp_sent = True
        queue_time = req.metrics.time_in_queue
        if delta and queue_time is not None:  # likewise once in a stream
            queue_time = None if req.queue_time_sent else queue_time
            req.queue_time_sent = True
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outs,
            finished,
            req.num_cached,
            req.error,
            plp,
            queue_time,
            _spec_metrics(req.comps),
            req.metrics,
        )


def _spec_metrics(comps: list[_Completion]) -> SpecDecodeMetrics | None:
    """The request's :class:`SpecDecodeMetrics` (sums over its completions), None when speculative decoding
    is off."""
    counts = [c.spec for c in comps if c.spec is not None]
    if not counts:
        return None
    return SpecDecodeMetrics(*(sum(x[i] for x in counts) for i in range(3)))
