"""``POST /v1/completions``: OpenAI's legacy completions (vLLM's shapes and extras).

One engine request per prompt (id ``cmpl-<hex>-<i>``); choice ``index`` = prompt index x ``n`` + completion
index (vLLM's order). ``usage.prompt_tokens`` counts each prompt once, ``completion_tokens`` every choice's
tokens. ``echo`` puts the prompt (its text, or the decoded ids) before the completion; with ``logprobs`` the
prompt's logprobs come first (``SamplingParams.prompt_logprobs``), the first one null; ``max_tokens: 0``
with ``echo`` returns the prompt alone (the engine runs one token, which is dropped; ``finish_reason``
``"length"``, ``completion_tokens`` 0).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from .errors import OpenAIError, invalid_input
from .guard import arrival_of
from .logprobs import LegacyLogprobs
from .protocol import CompletionRequest
from .serving import ServerState, log, merge, random_id
from .sse import DONE, SSEResponse, event, until_disconnect

__all__ = ["create_completion"]


def _prompts(p: Any) -> list[str | list[int]]:
    if isinstance(p, str):
        return [p]
    if not p:
        raise OpenAIError(400, "prompt must not be empty.", param="prompt")
    if isinstance(p[0], int):
        return [list(p)]
    if any(isinstance(x, list) and not x for x in p):
        raise OpenAIError(400, "prompt token lists must not be empty.", param="prompt")
    return list(p)


class _Choice:
    """What one choice has gathered (the non-streamed response) or sent (the stream)."""

    def __init__(self, state: ServerState, want_lps: bool) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.lps = LegacyLogprobs(state.strings) if want_lps else None
        self.lp_parts: list[dict] = []
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.started = False


def _join(parts: list[dict]) -> dict | None:
    if not parts:
        return None
    return {
        k: [x for p in parts for x in p[k]]
        for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }


def _engine_error(out: Any) -> None:
    if any(c.finish_reason == "error" for c in out.outputs):
        raise OpenAIError(500, f"The request failed in the engine: {out.error}", type="server_error")


def _dead(state: ServerState, exc: Exception) -> OpenAIError:
    if getattr(state.engine, "errored", False) or type(exc).__name__ == "EngineDeadError":
        return OpenAIError(503, f"The engine is dead: {exc}", type="server_error")
    raise exc


def stream_error(state: ServerState, exc: Exception) -> bytes:
    """The SSE event that ends a stream which failed after its first chunk (the status line is sent by then):
    an :class:`OpenAIError` as it is, a dead engine as a 503 ``server_error``, anything else as a 500 whose
    traceback goes to the log (logger ``layerzero.engine.server``), never to the client."""
    if isinstance(exc, OpenAIError):
        return event(exc.body())
    try:
        err = _dead(state, exc)
    except Exception:
        log.error("stream failed: %s", exc, exc_info=exc)
        err = OpenAIError(500, f"Internal server error ({type(exc).__name__})", type="server_error")
    return event(err.body())


async def create_completion(state: ServerState, req: CompletionRequest, raw: Any) -> Any:
    """Validate everything first (400s before anything is queued), then stream or collect."""
    model = state.check_model(req.model)
    state.check_admission()
    prompts = _prompts(req.prompt)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not req.echo):
        raise OpenAIError(
            400, f"max_tokens must be >= 1 (0 only with echo), got {max_tokens}.", param="max_tokens"
        )
    echo_only = req.echo and max_tokens == 0
    prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
    params = state.sampling_params(req, max(max_tokens, 1), req.logprobs, prompt_logprobs=prompt_lps)
    tok = state.engine.tokenizer
    checked = []
    for p in prompts:
        try:
            text, ids = state.engine.validate(p, params, req.priority)
        except ValueError as exc:
            raise invalid_input(exc, {"logprobs": "logprobs"}) from exc
        state.check_length(len(ids), max_tokens)
        if text is None and req.echo:
            text = tok.decode(ids, skip_special_tokens=False) if tok is not None else ""
        checked.append((text, list(ids)))
    rid, created, n = random_id("cmpl"), int(time.time()), req.n
    arrival = arrival_of(raw)
    gens = [
        state.run(f"{rid}-{i}", ids, params, req.priority, text, arrival)
        for i, (text, ids) in enumerate(checked)
    ]
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    choices = {
        (i, j): _Choice(state, req.logprobs is not None) for i in range(len(checked)) for j in range(n)
    }
    usage = {"prompt_tokens": sum(len(ids) for _, ids in checked), "completion_tokens": 0}

    def piece(i: int, out: Any, c: Any) -> tuple[str, dict | None]:
        """The text and logprobs a delta adds to choice (i, c.index), the echoed prompt first."""
        ch = choices[(i, c.index)]
        text, lp = "", None
        ids, lps = ([], []) if echo_only else (list(c.token_ids), list(c.logprobs or []))
        if not ch.started:
            ch.started = True
            if req.echo:
                ptext, pids = checked[i]
                text = ptext
                pl = getattr(out, "prompt_logprobs", None)
                if ch.lps is not None:
                    if not pl:  # asked for and not given: an error, never a row of nulls (lm-eval sums them)
                        raise OpenAIError(
                            500, "The engine returned no prompt logprobs for echo.", type="server_error"
                        )
                    ch.lp_parts.append(ch.lps.add(pids, list(pl)))
        text += "" if echo_only else c.text
        if ch.lps is not None and ids:
            ch.lp_parts.append(ch.lps.add(ids, lps))
        if ch.lps is not None:
            lp, ch.lp_parts = _join(ch.lp_parts), []
        usage["completion_tokens"] += len(ids)
        ch.ids += ids
        if c.finish_reason is not None:
            ch.finish = "length" if echo_only else c.finish_reason
            ch.stop_reason = None if echo_only else c.stop_reason
        return text, lp

    def usage_dict() -> dict:
        return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}

    async def collect() -> Any:
        from fastapi.responses import JSONResponse

        texts: dict[tuple[int, int], list[str]] = {k: [] for k in choices}
        lpp: dict[tuple[int, int], list[dict]] = {k: [] for k in choices}
        try:
            async for i, out in merge(gens):
                _engine_error(out)
                for c in out.outputs:
                    text, lp = piece(i, out, c)
                    texts[(i, c.index)].append(text)
                    if lp is not None:
                        lpp[(i, c.index)].append(lp)
        except OpenAIError:
            raise
        except Exception as exc:
            raise _dead(state, exc) from exc
        body = dict(head)
        body["choices"] = [
            {
                "index": i * n + j,
                "text": "".join(texts[(i, j)]),
                "logprobs": _join(lpp[(i, j)]) if req.logprobs is not None else None,
                "finish_reason": ch.finish,
                "stop_reason": ch.stop_reason,
            }
            for (i, j), ch in sorted(choices.items())
        ]
        body["usage"] = usage_dict()
        return JSONResponse(body)

    async def stream() -> AsyncIterator[bytes]:
        include = req.stream_options is not None and req.stream_options.include_usage
        try:
            async for i, out in merge(gens):
                _engine_error(out)
                for c in out.outputs:
                    text, lp = piece(i, out, c)
                    fin = choices[(i, c.index)].finish
                    if not text and lp is None and fin is None and not c.token_ids:
                        continue  # a chunk per step with new tokens, text or not (vLLM: no-tokenizer models)
                    chunk = dict(head)
                    chunk["choices"] = [
                        {
                            "index": i * n + c.index,
                            "text": text,
                            "logprobs": lp,
                            "finish_reason": fin,
                            "stop_reason": choices[(i, c.index)].stop_reason,
                        }
                    ]
                    if include:
                        chunk["usage"] = None
                    yield event(chunk)
            if include:
                yield event({**head, "choices": [], "usage": usage_dict()})
        except Exception as exc:
            yield stream_error(state, exc)
        yield DONE

    if req.stream:
        return SSEResponse(stream())
    return await until_disconnect(raw, collect())
