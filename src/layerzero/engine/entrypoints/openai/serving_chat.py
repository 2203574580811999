"""``POST /v1/chat/completions``: OpenAI's chat completions on the tokenizer's chat template.

``messages`` (system / developer / user / assistant; ``content`` a string or a list of text parts, joined
with newlines as vLLM does) go through ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``;
one engine request (id ``chatcmpl-<hex>``) with ``n`` completions, choice ``index`` = completion index.
``max_completion_tokens`` (or the older ``max_tokens``) defaults to what the context leaves, capped by
``--max-tokens-limit``. ``logprobs: true`` with ``top_logprobs`` N (0-20) returns OpenAI's chat logprobs.
A stream sends, per choice, a first chunk with ``delta: {"role": "assistant", "content": ""}``, then content
deltas, the last with ``finish_reason``; with ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk has empty ``choices`` and the usage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from .errors import OpenAIError
from .guard import arrival_of
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest, ChatMessage
from .serving import ServerState, merge, random_id
from .serving_completions import _dead, _engine_error, stream_error
from .sse import DONE, SSEResponse, event, until_disconnect

__all__ = ["chat_prompt", "create_chat_completion"]


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    conv = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content or "",
        }
        if m.name is not None:
            msg["name"] = m.name
        conv.append(msg)
    return conv


def chat_prompt(
    state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool, continue_final: bool
) -> list[int]:
    """The token ids of ``messages`` in the tokenizer's chat template (400 when there is none or it fails)."""
    tok = state.engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise OpenAIError(
            400, "This model's tokenizer has no chat template: use /v1/completions.", param="messages"
        )
    if continue_final and add_generation_prompt:
        raise OpenAIError(
            400, "continue_final_message needs add_generation_prompt false.", param="continue_final_message"
        )
    try:
        out = tok.apply_chat_template(
            _conversation(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            tokenize=True,
            return_dict=True,
        )
    except Exception as exc:  # jinja2's and the tokenizer's errors
        raise OpenAIError(
            400, f"The chat template failed on these messages: {type(exc).__name__}: {exc}", param="messages"
        ) from exc
    return list(out["input_ids"])


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Any) -> Any:
    """Validate everything first (400s before anything is queued), then stream or collect."""
    model = state.check_model(req.model)
    state.check_admission()
    ids = chat_prompt(state, req.messages, req.add_generation_prompt, req.continue_final_message)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        left = state.max_model_len - len(ids)
        max_tokens = max(1, min(left, state.max_tokens_limit or left))
    if max_tokens < 1:
        raise OpenAIError(400, f"{field} must be >= 1, got {max_tokens}.", param=field)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    params = state.sampling_params(
        req, max_tokens, top_n, _rename={"logprobs": "top_logprobs", "max_tokens": field}
    )
    try:
        state.engine.validate(ids, params, req.priority)
    except ValueError as exc:
        from .errors import invalid_input

        raise invalid_input(exc, {"logprobs": "top_logprobs", "prompt": "messages"}) from exc
    state.check_length(len(ids), max_tokens, "messages")
    rid, created, n = random_id("chatcmpl"), int(time.time()), req.n
    gen = state.run(rid, ids, params, req.priority, None, arrival_of(raw))
    head = {"id": rid, "object": "chat.completion", "created": created, "model": model}
    usage = {"prompt_tokens": len(ids), "completion_tokens": 0}

    def lps_of(c: Any) -> dict | None:
        if top_n is None:
            return None
        return chat_logprobs(state.strings, list(c.token_ids), list(c.logprobs or []), top_n)

    def usage_dict() -> dict:
        return {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}

    async def collect() -> Any:
        from fastapi.responses import JSONResponse

        texts: list[list[str]] = [[] for _ in range(n)]
        lps: list[list[dict]] = [[] for _ in range(n)]
        fin: list[Any] = [None] * n
        stop: list[Any] = [None] * n
        try:
            async for _, out in merge([gen]):
                _engine_error(out)
                for c in out.outputs:
                    texts[c.index].append(c.text)
                    usage["completion_tokens"] += len(c.token_ids)
                    lp = lps_of(c)
                    if lp is not None:
                        lps[c.index] += lp["content"]
                    if c.finish_reason is not None:
                        fin[c.index], stop[c.index] = c.finish_reason, c.stop_reason
        except OpenAIError:
            raise
        except Exception as exc:
            raise _dead(state, exc) from exc
        body = dict(head)
        body["choices"] = [
            {
                "index": j,
                "message": {"role": "assistant", "content": "".join(texts[j])},
                "logprobs": {"content": lps[j]} if top_n is not None else None,
                "finish_reason": fin[j],
                "stop_reason": stop[j],
            }
            for j in range(n)
        ]
        body["usage"] = usage_dict()
        return JSONResponse(body)

    async def stream() -> AsyncIterator[bytes]:
        include = req.stream_options is not None and req.stream_options.include_usage
        chead = {**head, "object": "chat.completion.chunk"}

        def chunk(j: int, delta: dict, lp: dict | None = None, fin: Any = None, stop: Any = None) -> bytes:
            choice = {"index": j, "delta": delta, "logprobs": lp, "finish_reason": fin}
            if fin is not None:
                choice["stop_reason"] = stop
            body = {**chead, "choices": [choice]}
            if include:
                body["usage"] = None
            return event(body)

        try:
            for j in range(n):
                yield chunk(j, {"role": "assistant", "content": ""})
            async for _, out in merge([gen]):
                _engine_error(out)
                for c in out.outputs:
                    usage["completion_tokens"] += len(c.token_ids)
                    if not c.text and c.finish_reason is None and (top_n is None or not c.token_ids):
                        continue
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    yield chunk(c.index, delta, lps_of(c), c.finish_reason, c.stop_reason)
            if include:
                yield event({**chead, "choices": [], "usage": usage_dict()})
        except Exception as exc:
            yield stream_error(state, exc)
        yield DONE

    if req.stream:
        return SSEResponse(stream())
    return await until_disconnect(raw, collect())
