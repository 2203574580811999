"""OpenAI's error object and the exception handlers that make every failure one: ``{"error": {"message",
"type", "param", "code"}}`` with the right status, never a traceback and never FastAPI's 422.

=====  ===============================  =====================================================================
status type                             when
=====  ===============================  =====================================================================
400    ``invalid_request_error``        an invalid value, an unknown field ("Unrecognized request argument
                                        supplied: X"), a field not implemented, malformed JSON; ``param``
                                        names the field
401    ``invalid_request_error``        missing or wrong API key (``code`` ``invalid_api_key``)
404    ``invalid_request_error``        unknown model (``code`` ``model_not_found``) or route
405    ``invalid_request_error``        a route called with the wrong method
408    ``invalid_request_error``        a body slower than ``--request-body-timeout`` (``request_timeout``)
413    ``invalid_request_error``        a body over ``--max-request-bytes`` (``code`` ``request_too_large``)
500    ``server_error``                 a request that failed inside the engine (the reason, no traceback)
503    ``server_error``                 the waiting queue is full or the server drains (``Retry-After``); the
                                        engine died
=====  ===============================  =====================================================================
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["OpenAIError", "error_body", "install_handlers", "invalid_input"]

log = logging.getLogger("layerzero.engine.server")


class OpenAIError(Exception):
    """An error answered as OpenAI's error object (raise it from a handler; :func:`install_handlers` turns it
    into the response)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:  # noqa: A002
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_PARAM = re.compile(r"^SamplingParams\.(\w+)")
_RENAME = {"prompts": "prompt", "prompt token ids": "prompt", "chat messages": "messages"}


def invalid_input(exc: Exception, rename: dict[str, str] | None = None) -> OpenAIError:
    """A 400 for a :class:`layerzero.InvalidInputError` of the engine
    (``"SamplingParams.top_p: expected ...``): ``param`` is the request's field it names (``rename`` maps
    engine names to this endpoint's fields)."""
    msg = str(exc)
    m = _PARAM.match(msg)
    param = m.group(1) if m else None
    if param is None:
        head = msg.split(":", 1)[0].strip().lower()
        param = _RENAME.get(head) or ("prompt" if head.startswith("prompt") else None)
    if param is not None and rename:
        param = rename.get(param, param)
    return OpenAIError(400, msg, param=param)


def _validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """FastAPI's ``RequestValidationError`` (pydantic's errors) as OpenAI's 400: the first error decides."""
    err = errors[0] if errors else {"type": "unknown", "loc": (), "msg": "invalid request"}
    loc = [x for x in err.get("loc", ()) if x != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return OpenAIError(400, f"Invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
    # pydantic names the member of a union that failed ("str", "list[int]", "function-after[...]"): drop it
    path = [
        x
        for x in loc
        if isinstance(x, int) or not re.match(r"^(list|str|int|dict|float|bool)\b|^function-", x)
    ]
    field = ".".join(f"[{x}]" if isinstance(x, int) else str(x) for x in path)
    if kind == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {field}", param=field)
    if kind == "missing" and field:
        return OpenAIError(400, f"Missing required parameter: '{field}'.", param=field)
    if not field:
        return OpenAIError(400, f"Invalid request body: {err.get('msg')}; expected a JSON object.")
    return OpenAIError(400, f"Invalid value for '{field}': {err.get('msg')}.", param=field)


def install_handlers(app: Any) -> None:
    """Map every exception to OpenAI's error object: ours, pydantic's (400, never 422), Starlette's HTTP
    errors (404 / 405 / ...) and anything unexpected (500, logged with its traceback, answered without)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    import layerzero as lz

    @app.exception_handler(OpenAIError)
    async def _ours(request: Any, exc: OpenAIError) -> Any:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Any, exc: RequestValidationError) -> Any:
        return _validation_error(list(exc.errors())).response()

    @app.exception_handler(lz.InvalidInputError)
    async def _invalid(request: Any, exc: Exception) -> Any:
        return invalid_input(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Any, exc: HTTPException) -> Any:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        msg = {404: f"Not found: {request.url.path}", 405: f"Method {request.method} not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        return JSONResponse(
            error_body(msg, kind), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Any, exc: Exception) -> Any:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(
            error_body(f"Internal server error ({type(exc).__name__})", "server_error"), status_code=500
        )
