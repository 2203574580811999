"""What the endpoints share: the server's state, admission (model name, queue bound, draining), the OpenAI
fields -> :class:`~layerzero.engine.SamplingParams` mapping, and running one engine request (abort when the
consumer leaves, metrics, one log line when it ends)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from layerzero.engine import RequestMetrics, SamplingParams

from .errors import OpenAIError, invalid_input
from .logprobs import TokenStrings
from .metrics import RequestClock, ServerMetrics
from .protocol import UNSUPPORTED
from .structured import structured_outputs_from

__all__ = ["ServerState", "merge", "random_id"]

log = logging.getLogger("layerzero.engine.server")


def random_id(prefix: str) -> str:
    """``cmpl-`` / ``chatcmpl-`` + 32 hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServerState:
    """One server: the engine (an ``AsyncLLM``), the served names and limits, metrics, and the requests in
    flight (aborted when the drain times out)."""

    engine: Any
    model_names: list[str]
    model_root: str = ""
    max_waiting_requests: int | None = None
    max_tokens_limit: int | None = None
    log_requests: bool = False
    retry_after_s: int = 1
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    active: set[str] = field(default_factory=set)
    metrics: ServerMetrics | None = None
    _strings: TokenStrings | None = None

    @property
    def strings(self) -> TokenStrings:
        if self._strings is None:
            self._strings = TokenStrings(self.engine.tokenizer)
        return self._strings

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    # ------------------------------------------------------------------------------------------ admission
    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (None: the first); 404 for any other."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise OpenAIError(
                404,
                f"The model `{name}` does not exist. Served: {', '.join(self.model_names)}.",
                param="model",
                code="model_not_found",
            )
        return name

    def check_admission(self) -> None:
        """503 with ``Retry-After`` while draining, when the engine is dead, or when the queue is full."""
        retry = {"Retry-After": str(self.retry_after_s)}
        if self.draining:
            raise OpenAIError(503, "The server is shutting down.", type="server_error", headers=retry)
        if getattr(self.engine, "errored", False):
            raise OpenAIError(503, f"The engine is dead: {self.engine.dead_error}", type="server_error")
        cap = self.max_waiting_requests
        if cap is not None and int(getattr(self.engine, "num_waiting", 0)) >= cap:
            raise OpenAIError(
                503,
                f"The server is overloaded: {cap} requests already wait. Retry later.",
                type="server_error",
                code="queue_full",
                headers=retry,
            )

    # ------------------------------------------------------------------------------------------ params
    def sampling_params(
        self, req: Any, max_tokens: int, logprobs: int | None, **extra: Any
    ) -> SamplingParams:
        """The request's :class:`SamplingParams` (400 naming the field for anything invalid or
        unsupported)."""
        for name in UNSUPPORTED:
            if getattr(req, name, None) is not None:
                raise OpenAIError(400, f"'{name}' is not supported by this server.", param=name)
        best_of = getattr(req, "best_of", None)
        if best_of is not None and best_of != req.n:
            raise OpenAIError(
                400, f"best_of ({best_of}) must equal n ({req.n}): no ranking.", param="best_of"
            )
        constraint = structured_outputs_from(req)  # response_format / structured_outputs (400 if malformed)
        bias = None
        if req.logit_bias is not None:
            try:
                bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise OpenAIError(400, "logit_bias keys must be token ids.", param="logit_bias") from None
        limit = self.max_tokens_limit
        if limit is not None and max_tokens > limit:
            raise OpenAIError(
                400, f"max_tokens ({max_tokens}) is over this server's limit ({limit}).", param="max_tokens"
            )
        kw = dict(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=bias,
            stop=req.stop or None,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            seed=req.seed,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=constraint,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words or None,
        )
        try:
            return make_params(**kw, **extra)
        except ValueError as exc:  # InvalidInputError
            raise invalid_input(exc, extra.pop("_rename", None)) from exc

    def check_length(self, n_prompt: int, max_tokens: int, what: str = "prompt") -> None:
        """vLLM's 400 when prompt + max_tokens exceed the context."""
        cap = self.max_model_len
        if n_prompt + max_tokens > cap:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {cap} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or of the completion.",
                param="max_tokens" if n_prompt < cap else what,
            )

    # ------------------------------------------------------------------------------------------ running
    async def run(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        priority: int,
        text: str | None,
        arrival: float | None = None,
    ) -> AsyncIterator[Any]:
        """Stream one engine request's deltas; leaving early (the client left, an error, cancellation) aborts
        it. Feeds the metrics and logs one line when it ends. ``arrival``: when the HTTP request arrived
        (``guard.arrival_of``; None: now), where its ``ttft_s`` and latency start."""
        engine, m = self.engine, self.metrics
        clock = m.clock(len(ids), arrival) if m is not None else None
        self.active.add(rid)
        finished, reasons, n_out, times = False, [None] * params.n, 0, None
        try:
            async for out in engine.generate(ids, params, rid, priority=priority):
                times = getattr(out, "metrics", None) or times
                k = sum(len(c.token_ids) for c in out.outputs)
                n_out += k
                if clock is not None:
                    clock.tokens(k, getattr(out, "queue_time", None))
                for c in out.outputs:
                    if c.finish_reason is not None:
                        reasons[c.index] = c.finish_reason
                finished = out.finished
                yield out
                if finished:
                    break
        finally:
            self.active.discard(rid)
            if not finished:
                reasons = [r or "abort" for r in reasons]
                await asyncio.shield(_abort(engine, rid))
            e2e = clock.finish(reasons) if clock is not None else None
            line = {
                "event": "request_finished",
                "request_id": rid,
                "pid": os.getpid(),  # the API-server process (--api-server-count > 1: one of several)
                "prompt_tokens": len(ids),
                "output_tokens": n_out,
                "ttft_s": None if clock is None or clock.ttft is None else round(clock.ttft, 6),
                "latency_s": None if e2e is None else round(e2e, 6),
                "finish_reason": reasons if len(reasons) > 1 else reasons[0],
                "ttft_breakdown_ms": None if clock is None else ttft_breakdown(clock, times),
            }
            if self.log_requests:
                line["prompt"] = text if text is not None else ids
            log.info(json.dumps(line))


def ttft_breakdown(clock: RequestClock, times: RequestMetrics | None) -> dict[str, float] | None:
    """Where a request's time to first token went, in milliseconds (None before its first token, or from an
    engine that does not time requests): ``http`` (the HTTP request's arrival until its engine request
    started: the body's parsing and validation, the chat template, tokenization), ``input`` (the engine's
    input processing until it sent the request to the core), :meth:`RequestMetrics.ttft_breakdown`'s
    ``to_core``, ``queue``, ``engine`` and ``to_front_end``, and ``to_stream`` (the front end's handling
    until this request's stream saw the token). Their sum is the server's ``ttft_s``; the HTTP request's
    own transfer before and the response's write after are not in it."""
    parts = None if times is None else times.ttft_breakdown()
    if parts is None or clock.first is None or times is None or times.first_token_received_time is None:
        return None
    return {
        "http": round(1e3 * (clock.started - clock.arrival), 3),
        "input": round(1e3 * (times.arrival_time - clock.started), 3),
        **parts,
        "to_stream": round(1e3 * (clock.first - times.first_token_received_time), 3),
    }


async def _abort(engine: Any, rid: str) -> None:
    try:
        await engine.abort(rid)
    except Exception:  # a dead engine: nothing left to free
        log.debug("abort of %s failed", rid, exc_info=True)


def make_params(**kw: Any) -> SamplingParams:
    """``SamplingParams(**kw)``; ``prompt_logprobs`` is passed only when asked for (an engine whose
    ``SamplingParams`` lacks it refuses echo + logprobs with a 400)."""
    kw.pop("_rename", None)
    if kw.get("prompt_logprobs") is None:
        kw.pop("prompt_logprobs", None)
    elif "prompt_logprobs" not in {f.name for f in dataclasses.fields(SamplingParams)}:
        raise OpenAIError(
            400, "echo with logprobs needs prompt logprobs, which this engine lacks.", param="echo"
        )
    return SamplingParams(**kw)


async def merge(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come, as ``(which, item)``; closing the merge (or an error
    in one) cancels and closes them all (each engine request aborts itself)."""
    if len(gens) == 1:
        try:
            async for x in gens[0]:
                yield 0, x
        finally:
            await gens[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Any) -> None:
        try:
            async for x in g:
                q.put_nowait((i, x, None))
            q.put_nowait((i, None, None))
        except Exception as exc:
            q.put_nowait((i, None, exc))
        finally:
            await g.aclose()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, x, exc = await q.get()
            if exc is not None:
                raise exc
            if x is None:
                left -= 1
                continue
            yield i, x
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
