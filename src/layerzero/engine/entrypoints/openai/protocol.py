"""The request bodies of the OpenAI-compatible server (pydantic models; OpenAI's and vLLM's field names).

Every model is strict (``"1"`` is not a number, ``true`` is not an int) and forbids unknown fields: OpenAI
answers "Unrecognized request argument supplied: X" for those, and so do we (errors.py maps pydantic's
``extra_forbidden`` to that message, with the field in ``param``). Fields OpenAI has but this server does not
implement are declared (so the schema shows them) and refused when set: :data:`UNSUPPORTED` names them.
Ranges are checked by :class:`~layerzero.engine.SamplingParams` (its message names the field); the
server-level limits (``max_tokens`` against ``--max-tokens-limit`` and the context) in the serving modules.
Responses are plain dicts built by the serving modules.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TextPart",
    "TokenizeRequest",
    "MAX_N",
    "UNSUPPORTED",
]


MAX_N = 128
"""The most choices one request may ask for (OpenAI's limit): ``n`` sets how many sequences the engine forks
and how many choices the handler builds, so an unbounded ``n`` (``10**30`` passes ``SamplingParams``) would
stall the event loop building choices."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and empty ``choices``."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    structured_outputs: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a token-id list or a list of
    token-id lists; ``max_tokens`` defaults to 16 (0 only with ``echo``: the prompt and its logprobs alone);
    ``logprobs`` 0-20 (OpenAI's legacy shape); ``echo`` returns the prompt before the completion (with
    ``logprobs``, the prompt's too, the first one null)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None


class TextPart(_Strict):
    """One part of a message's ``content`` list: only text parts (no images or audio)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message: ``role`` system / user / assistant (``developer`` is OpenAI's new name for system),
    ``content`` a string or a list of text parts; ``name`` is passed to the template."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template; ``max_tokens``
    or ``max_completion_tokens`` (default: what the context leaves, capped by ``--max-tokens-limit``);
    ``logprobs`` (bool) with ``top_logprobs`` 0-20 (OpenAI's chat shape)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    web_search_options: Any = None


UNSUPPORTED = (
    "suffix",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "store",
    "metadata",
    "service_tier",
    "web_search_options",
)
"""OpenAI fields this server knows but does not implement: a request that sets one (not null) is refused
with 400 naming it (never silently ignored)."""


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` text, or ``messages`` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape): ``tokens`` back to text."""

    model: str | None = None
    tokens: list[int]
