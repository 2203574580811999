"""The OpenAI-compatible HTTP server of ``layerzero serve`` (FastAPI + uvicorn): :func:`build_app` (the app on
an engine), :func:`add_server_args` (the server's flags) and :func:`run_server` (build the ``AsyncLLM``,
serve, drain on SIGTERM / SIGINT, exit 0). docs/serving.md describes every endpoint, flag, metric and error.

FastAPI, uvicorn and prometheus-client are imported here, inside functions: ``import layerzero`` and
``import layerzero.engine`` never import them.
"""

import argparse
import importlib.util
import ipaddress
import logging
import os
import time
from pathlib import Path
from typing import Any

from .errors import OpenAIError, error_body, install_handlers
from .guard import Guard
from .metrics import ServerMetrics
from .serving import ServerState

__all__ = ["ServerState", "add_server_args", "build_app", "check_bind", "run_server"]

log = logging.getLogger("layerzero.engine.server")


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's flags (the engine's come from ``layerzero.cli_engine.add_engine_args``)."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $LAYERZERO_API_KEY)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) clients send (default: the checkpoint directory's name)",
    )
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 + Retry-After while this many requests wait to be scheduled (default: no bound)",
    )
    g.add_argument(
        "--max-request-bytes", type=int, default=1 << 20, help="largest request body, bytes (default 1 MiB)"
    )
    g.add_argument(
        "--request-body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive whole; slower bodies get 408 and the connection "
        "closes (default 30; 0: no limit)",
    )
    g.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: only the context bounds it)",
    )
    g.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="allow binding a non-loopback address without an API key",
    )
    g.add_argument(
        "--log-requests", action="store_true", help="include the prompt in each request's log line"
    )
    g.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="API-server processes sharing the port in front of the engine cores (default: "
        "--data-parallel-size, as vLLM); one process streams some 30-40k tokens/s",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / SIGINT, seconds running requests may take to finish before they are aborted",
    )
    return parser


def _api_key(args: Any) -> str | None:
    key = getattr(args, "api_key", None)
    return key if key else os.environ.get("LAYERZERO_API_KEY") or None


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """Refuse a non-loopback address without an API key unless ``allow_unauthenticated``.

    Raises:
        ConfigurationError: the host is reachable from other machines and nothing authenticates clients.
    """
    import layerzero as lz

    if api_key or allow_unauthenticated:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise lz.ConfigurationError(
            "--host: expected a loopback address (127.0.0.1, ::1, localhost) without an API key, got "
            f"{host!r}. Set --api-key (or LAYERZERO_API_KEY), or pass --allow-unauthenticated to serve "
            "anyone who can reach this address."
        )


def build_app(engine: Any, args: Any) -> Any:
    """The FastAPI app serving ``engine`` (an ``AsyncLLM``) with the options of :func:`add_server_args`
    (``args``: a namespace; missing options take their defaults; ``args.model`` names the checkpoint).
    ``app.state.server`` is the :class:`ServerState` (``draining`` is set by :func:`run_server`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    import layerzero as lz

    from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
    from .responses import (
        ERRORS,
        DetokenizeResponse,
        ModelList,
        TokenizeResponse,
        VersionResponse,
        document,
        responses,
    )
    from .responses import ChatCompletionResponse as ChatOut
    from .responses import CompletionResponse as CompletionOut
    from .serving_chat import create_chat_completion
    from .serving_completions import create_completion
    from .serving_tokenize import detokenize, list_models, tokenize

    opt = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    model = str(opt("model", "") or "")
    names = list(opt("served_model_name") or []) or [Path(model).name or "model"]
    state = ServerState(
        engine,
        names,
        model_root=model,
        max_waiting_requests=opt("max_waiting_requests"),
        max_tokens_limit=opt("max_tokens_limit"),
        log_requests=bool(opt("log_requests", False)),
        metrics=ServerMetrics(names[0]),
    )
    enable_counters = getattr(engine, "enable_dispatch_counters", None)
    if enable_counters is not None and opt("dispatch_counters", True):
        try:  # LayerZero's dispatch counters, kept in the engine core's process (where the kernels run)
            enable_counters()
        except Exception:  # a dead engine: /health says so
            log.warning("could not enable the engine core's dispatch counters", exc_info=True)
    # 401 (any route but /health, when a key is set), 408 and 413 (the body) come from the Guard middleware
    app = FastAPI(
        title="LayerZero OpenAI-compatible server",
        version=lz.__version__,
        responses={s: ERRORS[s] for s in (401, 408, 413)},
    )
    app.state.server = state
    install_handlers(app)
    document(app)
    serving_errors = (400, 404, 500, 503)

    @app.post("/v1/completions", responses=responses(CompletionOut, *serving_errors, stream=True))
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await create_completion(state, body, raw)

    @app.post("/v1/chat/completions", responses=responses(ChatOut, *serving_errors, stream=True))
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(state, body, raw)

    @app.get("/v1/models", responses=responses(ModelList))
    async def models() -> Any:
        return list_models(state)

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "Healthy (empty body)"}, 503: ERRORS[503]},
    )
    async def health() -> Any:
        if getattr(engine, "errored", False):
            msg = f"The engine is dead: {getattr(engine, 'dead_error', None)}"
            return JSONResponse(error_body(msg, "server_error"), status_code=503)
        if state.draining:
            return JSONResponse(
                error_body("The server is shutting down.", "server_error"),
                status_code=503,
                headers={"Retry-After": str(state.retry_after_s)},
            )
        return Response(status_code=200)

    @app.get("/version", responses=responses(VersionResponse))
    async def version() -> Any:
        return {"version": lz.__version__}

    @app.post("/tokenize", responses=responses(TokenizeResponse, 400, 404))
    async def tokenize_route(body: TokenizeRequest) -> Any:
        return tokenize(state, body)

    @app.post("/detokenize", responses=responses(DetokenizeResponse, 400, 404))
    async def detokenize_route(body: DetokenizeRequest) -> Any:
        return detokenize(state, body)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            state.metrics.update(await engine.get_stats())
            if hasattr(engine, "dispatch_counters"):
                state.metrics.update_dispatch(await engine.dispatch_counters())
        except Exception:  # a dead engine: serve what the front end knows
            log.debug("get_stats failed", exc_info=True)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/layerzero/kernels", responses=responses(None, 503))
    async def kernels() -> Any:
        try:
            return await engine.kernel_report()
        except Exception as exc:
            raise OpenAIError(
                503, f"The engine could not report its kernels: {exc}", type="server_error"
            ) from exc

    app.add_middleware(
        Guard,
        api_key=_api_key(args),
        max_request_bytes=opt("max_request_bytes", 1 << 20),
        request_body_timeout=opt("request_body_timeout", 30.0),
    )
    return app


def run_server(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """``layerzero serve``: build the ``AsyncLLM`` from ``engine_options`` (the ``LLM`` keywords the engine
    flags set: ``layerzero.cli_engine.engine_kwargs``; the CLI passes them, so this module never imports the
    CLI), serve until SIGTERM / SIGINT, drain
    (new requests 503, running ones finish for up to ``--drain-timeout`` seconds, then are aborted), shut the
    engine down and return 0.

    Raises:
        ConfigurationError: a non-loopback ``--host`` without an API key (before the model is loaded); a bad
            engine option.
    """
    import uvicorn

    from layerzero.engine import AsyncLLM

    check_bind(args.host, _api_key(args), bool(args.allow_unauthenticated))
    configure_logging()
    count = _api_server_count(args, engine_options)
    if count > 1:
        from layerzero.engine.async_llm import replica_configs
        from layerzero.engine.config import EngineConfig, ModelConfig

        from .api_servers import run_api_servers

        options = {k: v for k, v in engine_options.items() if k not in ("model", "_core_factory")}
        config = EngineConfig(str(engine_options["model"]), **options)  # bad options fail here, typed
        ModelConfig.from_pretrained(config.model)  # and a bad checkpoint directory
        return run_api_servers(
            args, engine_options, count, replica_configs(config), run_api_worker, _http_stack()
        )
    engine = AsyncLLM(**engine_options)
    try:
        app = build_app(engine, args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False)
        server = DrainingServer(config, app.state.server, float(args.drain_timeout))
        log.info("serving %s on http://%s:%d (%s)", args.model, args.host, args.port, _http_stack())
        server.run()
    finally:
        engine.shutdown()
    return 0


def _watch_parent() -> None:
    """In an API server: SIGTERM itself (drain, exit) when the launcher is gone."""
    import multiprocessing
    import multiprocessing.connection
    import signal
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="layerzero-parent-watch", daemon=True).start()


def run_api_worker(
    index: int, args: Any, engine_options: dict[str, Any], endpoints: list[dict[str, Any]], sock: Any
) -> None:
    """An API-server process's main (``layerzero serve --api-server-count`` > 1, spawned by
    :func:`~.api_servers.run_api_servers`): attach an ``AsyncLLM`` to the shared cores (``endpoints``), serve
    the listening socket ``sock`` until SIGTERM (drain), shut the front end down (the cores stay: the
    launcher stops them). A start-up error is logged in one line and exits 1."""
    os.setpgrp()  # the terminal's Ctrl-C reaches the launcher only, which forwards it once
    configure_logging()
    _watch_parent()
    import uvicorn

    import layerzero as lz
    from layerzero.engine import AsyncLLM

    try:
        engine = AsyncLLM(**engine_options, _attach=endpoints)
    except lz.LayerZeroError as exc:  # start-up failed (its message says what and how to fix): no traceback
        log.error("API server %d: %s: %s", index, type(exc).__name__, exc)
        raise SystemExit(1) from None
    try:
        app = build_app(engine, args)
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        server = DrainingServer(config, app.state.server, float(args.drain_timeout))
        server.run(sockets=[sock])
    finally:
        engine.shutdown()


def _api_server_count(args: Any, engine_options: dict[str, Any]) -> int:
    """``--api-server-count`` (None: ``data_parallel_size``, as vLLM).

    Raises:
        ConfigurationError: a count < 1."""
    import layerzero as lz

    count = getattr(args, "api_server_count", None)
    if count is None:
        return int(engine_options.get("data_parallel_size") or 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise lz.ConfigurationError(
            f"--api-server-count: expected an int >= 1, got {count!r}. Pass 1 for one API-server process."
        )
    return count


def configure_logging(stream: Any = None) -> logging.Handler | None:
    """Print LayerZero's log records (the start-up line, one ``request_finished`` JSON line per request
    with its ``ttft_breakdown_ms``, warnings) to ``stream`` (None: stderr) as uvicorn prints its own, at
    INFO unless ``LAYERZERO_LOG_LEVEL`` or the application set a level. Does nothing when the ``layerzero``
    logger or the root logger has a handler already (the application configured logging); returns the
    handler added."""
    lg = logging.getLogger("layerzero")
    if lg.handlers or logging.getLogger().handlers:
        return None
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    lg.addHandler(handler)
    if lg.level == logging.NOTSET:  # LAYERZERO_LOG_LEVEL, applied when LayerZero's config loads, wins
        lg.setLevel(logging.INFO)
    return handler


def _http_stack(find_spec: Any = importlib.util.find_spec) -> str:
    """What uvicorn's ``loop="auto"`` and ``http="auto"`` pick: uvloop's loop and httptools' parser when
    installed (the serve extra installs both), else asyncio's loop and h11 (``find_spec``: importlib's)."""
    loop = "uvloop" if find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if find_spec("httptools") is not None else "h11"
    return f"uvicorn on {loop}, {http} parser"


def _server_class() -> type:
    import uvicorn

    class _Draining(uvicorn.Server):
        """uvicorn's server whose first SIGTERM / SIGINT drains instead of stopping: ``/health`` and new
        requests answer 503, running requests continue for up to ``drain_timeout`` seconds (then they are
        aborted and their clients get ``finish_reason: "abort"``), then the server stops. A second signal
        stops at once. The signal is not re-raised afterwards, so the process exits 0."""

        def __init__(self, config: Any, state: ServerState, drain_timeout: float) -> None:
            super().__init__(config)
            self.state, self.drain_timeout = state, drain_timeout
            self.drain_started: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.drain_started is None:
                self.drain_started = time.monotonic()
                self.state.draining = True
                log.info("draining: %d requests running (signal %d)", len(self.state.active), sig)
            elif not self.should_exit:
                self.should_exit = True
            else:
                self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if self.drain_started is not None and not self.should_exit:
                late = time.monotonic() - self.drain_started > self.drain_timeout
                if late:
                    for rid in list(self.state.active):
                        await self.state.engine.abort(rid)
                if not self.state.active:
                    self.should_exit = True
            return await super().on_tick(counter)

    return _Draining


def DrainingServer(config: Any, state: ServerState, drain_timeout: float) -> Any:  # noqa: N802
    """A uvicorn server that drains on its first signal (see ``_server_class``)."""
    return _server_class()(config, state, drain_timeout)
