"""``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes) and ``GET /v1/models``.

- ``/tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true}`` -> ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``
  with ``return_token_strs``: each token's display string, as in logprobs; else null).
- ``/detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}``; ids outside the vocabulary are a 400.
- ``/v1/models``: ``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by", "root",
  "parent", "max_model_len"}]}``.
"""

from __future__ import annotations

from typing import Any

from .errors import OpenAIError
from .protocol import DetokenizeRequest, TokenizeRequest
from .serving import ServerState
from .serving_chat import chat_prompt

__all__ = ["detokenize", "list_models", "tokenize"]


def _tokenizer(state: ServerState) -> Any:
    tok = state.engine.tokenizer
    if tok is None:
        raise OpenAIError(400, "This model has no tokenizer: send token ids.", param="prompt")
    return tok


def tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "Send exactly one of prompt and messages.", param="prompt")
    if req.messages is not None:
        ids = chat_prompt(state, req.messages, req.add_generation_prompt, req.continue_final_message)
    else:
        try:  # a lone surrogate ("\ud800" is valid JSON) is no text: the tokenizer raises a TypeError on it
            req.prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise OpenAIError(
                400,
                f"prompt: expected valid Unicode text (UTF-8 encodable), got {exc.reason}.",
                param="prompt",
            ) from None
        ids = list(_tokenizer(state)(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    strs = [state.strings.text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    tok = _tokenizer(state)
    vocab = int(getattr(state.engine.model_config, "vocab_size", None) or len(tok))
    bad = [t for t in req.tokens if not 0 <= t < min(vocab, len(tok))]
    if bad:
        raise OpenAIError(
            400, f"tokens: expected ids in [0, {min(vocab, len(tok))}), got {bad[:5]}.", param="tokens"
        )
    return {"prompt": tok.decode(req.tokens)}


def list_models(state: ServerState) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "layerzero",
                "root": state.model_root,
                "parent": None,
                "max_model_len": state.max_model_len,
            }
            for name in state.model_names
        ],
    }
