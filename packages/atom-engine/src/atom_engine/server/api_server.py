"""The OpenAI-compatible HTTP server: `build_app` (FastAPI) and `run_server` (`atom serve`).

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`: 400 for
a request that is invalid (pydantic validation included: FastAPI's 422 becomes 400), 401 for a
missing or wrong API key on /v1/*, 404 for an unknown model or route, 413 for a body over the
size limit, 500 for a bug (the connection stays open), 503 while shutting down; on Anthropic's
routes (`/v1/messages*`, `serving_messages`) the same errors take Anthropic's shape
`{"type": "error", "error": {"type", "message"}}`. No request can stop the server or fail
another request.

Shutdown (SIGTERM / SIGINT) stops accepting connections and lets requests in flight finish for
`drain_timeout` seconds; then the ones left end with an error (an error event when streaming)
and the process exits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import sys
import threading
from pathlib import Path

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_engine import __version__
from atom_engine.server.anthropic_protocol import (
    is_messages_path,
    messages_error_response,
    messages_validation_message,
)
from atom_engine.server.async_engine import AsyncEngine
from atom_engine.server.data_parallel import DataParallelEngine
from atom_engine.server.metrics import ServerMetrics
from atom_engine.server.middleware import BodySizeLimit, CatchAll
from atom_engine.server.openapi import install_openapi
from atom_engine.server.preprocess import Preprocessor
from atom_engine.server.profiler import Profiler
from atom_engine.server.protocol import (
    TOKENIZE_TAGS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    TokenizeRequest,
)
from atom_engine.server.reasoning import REASONING_PARSERS
from atom_engine.server.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from atom_engine.server.responses_api import serving as responses_api
from atom_engine.server.responses_api.store import DEFAULT_STORE_SIZE, ResponseStore
from atom_engine.server.serving_chat import create_chat_completion
from atom_engine.server.serving_common import APIError, ServerState
from atom_engine.server.serving_completion import create_completion
from atom_engine.server.serving_messages import register_messages
from atom_engine.server.serving_tokenize import detokenize, tokenize
from atom_engine.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("atom_engine.server")


def error_response(
    status: int, message: str, type_: str | None = None, param: str | None = None
) -> JSONResponse:
    info = ErrorInfo(
        message=message,
        type=type_ or APIError.TYPES.get(status, "APIError"),
        param=param,
        code=status,
    )
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


# pydantic error types whose context names the request field at fault
_CONTEXT_PARAM_ERRORS = ("unencodable_text", "stream_options_without_stream")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message for pydantic's errors, and the first offending field."""
    parts, param = [], None
    for error in exc.errors():
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if loc and loc[0] in TOKENIZE_TAGS:  # the tagged union of /tokenize's two bodies
            loc = loc[1:]
        kind = error.get("type")
        if kind == "json_invalid":
            return f"the request body is not valid JSON: {error.get('msg')}", None
        if kind in _CONTEXT_PARAM_ERRORS:
            return error["msg"], (error.get("ctx") or {}).get("param")
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) or "body"
        if kind == "extra_forbidden":
            parts.append(f"{where}: unknown or unsupported field (ATOM does not implement it)")
        else:
            parts.append(f"{where}: {error.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    # The Anthropic routes (/v1/messages...) answer errors in Anthropic's shape.
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if is_messages_path(request.url.path):
            return messages_error_response(exc.status, exc.message)
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        if is_messages_path(request.url.path):
            return messages_error_response(400, messages_validation_message(exc.errors()))
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if is_messages_path(request.url.path):
            return messages_error_response(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, str(exc.detail))


def _api_key_matches(authorization: str, api_key: str, x_api_key: str | None = None) -> bool:
    """`Authorization: Bearer <api_key>`, or `x-api-key: <api_key>` (Anthropic's clients),
    compared in constant time as bytes (a header is latin-1 text: a non-ASCII one must be
    refused, not fail the comparison)."""
    expected = api_key.encode("utf-8")
    if x_api_key is not None and secrets.compare_digest(x_api_key.encode("latin-1"), expected):
        return True
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(token.strip().encode("latin-1"), expected)


DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
# After the engine fails: how long /health answers 503 before the server stops.
FATAL_GRACE_S = 1.0


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    profiler_dir: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    responses_store_size: int = DEFAULT_STORE_SIZE,
) -> FastAPI:
    """The FastAPI app serving `engine` as `served_model_name` (also accepted: the model path).
    `tool_call_parser` / `reasoning_parser` name the model's formats (`tool_parsers`,
    `reasoning`); `responses_store_size` bounds the responses kept for `previous_response_id`."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(
            f"unknown tool-call parser {tool_call_parser!r}; ATOM has {sorted(TOOL_PARSERS)}"
        )
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {reasoning_parser!r}; ATOM has {sorted(REASONING_PARSERS)}"
        )
    aliases = {engine.model_path, Path(engine.model_path).name}
    if engine.engine.config.model:
        aliases.add(engine.engine.config.model)
    preprocessor = Preprocessor(engine.engine, engine.tokenizer)
    state = ServerState(
        engine,
        served_model_name,
        frozenset(aliases),
        ServerMetrics(engine),
        preprocessor,
        tool_call_parser,
        reasoning_parser,
    )
    responses_store = ResponseStore(responses_store_size)  # a bad size fails before the app
    profiler = Profiler(engine, profiler_dir)
    app = FastAPI(title="ATOM", version=__version__)
    app.state.atom = state
    _install_error_handlers(app)
    app.add_middleware(CatchAll)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        authorization = request.headers.get("authorization", "")
        x_api_key = request.headers.get("x-api-key")
        if not _api_key_matches(authorization, api_key, x_api_key):
            raise APIError("invalid or missing API key", status=401)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def models() -> ModelList:
        card = ModelCard(
            id=served_model_name, root=engine.model_path, max_model_len=engine.max_model_len
        )
        return ModelList(data=[card])

    @v1.post("/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await create_completion(state, request, raw_request)

    @v1.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await create_chat_completion(state, request, raw_request)

    register_messages(v1, state)  # Anthropic's /v1/messages
    responses_api.register(v1, state, responses_store)  # OpenAI's /v1/responses
    app.include_router(v1)

    # vLLM serves these outside /v1; here the API key guards them too (a chat template is work).
    @app.post("/tokenize", dependencies=[Depends(check_api_key)], response_model_exclude_none=True)
    async def tokenize_route(request: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(state, request)

    @app.post("/detokenize", dependencies=[Depends(check_api_key)])
    async def detokenize_route(request: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(state, request)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/start_profile")
    async def start_profile() -> dict:
        return {"status": "profiling", "directory": await profiler.start()}

    @app.post("/stop_profile")
    async def stop_profile() -> dict:
        return {"status": "stopped", "directory": await profiler.stop()}

    install_openapi(app)
    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn, whose graceful shutdown lasts at most `drain_timeout` seconds: then the requests
    still in flight are failed (their streams end with an error event) so their connections
    close, and uvicorn's own timeout cancels whatever is left a moment later."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        drain_timeout: float,
        stop_engine: bool = False,
    ) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        # Over several nodes the engine stops here, once drained: uvicorn re-raises SIGTERM /
        # SIGINT when `run` returns, which ends the process before `run_server`'s own shutdown,
        # and the other nodes' ranks need node 0's shutdown message to exit 0 (on one node the
        # workers end with their parent).
        self.stop_engine = stop_engine

    async def shutdown(self, sockets=None) -> None:
        def expire() -> None:
            logger.warning(
                "drain timeout (%.1f s) reached: failing the requests still in flight",
                self.drain_timeout,
            )
            self.engine.fail_all("the server is shutting down (drain timeout reached)")

        timer = asyncio.get_running_loop().call_later(self.drain_timeout, expire)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            if self.stop_engine:
                stop = functools.partial(self.engine.shutdown, timeout=1.0)
                await asyncio.get_running_loop().run_in_executor(None, stop)


def run_server(args) -> int:
    """`atom serve`: load the engine, then serve until interrupted; the exit status 0. When the
    engine fails (a tensor-parallel worker or a data-parallel replica died) the process exits
    with status 1 once the server has stopped."""
    from atom_engine.cli.args import engine_config_from_args

    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.max_request_body_bytes < 1:
        raise ValueError(
            f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}"
        )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    config = engine_config_from_args(args)
    if getattr(args, "headless", False) and config.node_rank == 0:
        raise ValueError("--headless is for nodes of --node-rank > 0: node 0 serves HTTP")
    if config.node_rank > 0:  # no API server here: this node's ranks follow node 0's
        from atom_engine.node_agent import run_node

        return run_node(config)
    if config.data_parallel_size > 1:
        engine = DataParallelEngine.from_config(config)
    else:
        engine = AsyncEngine.from_config(config)
    name = args.served_model_name or args.model or Path(engine.model_path).stem
    try:
        app = build_app(
            engine,
            name,
            args.api_key,
            profiler_dir=args.profiler_dir,
            max_request_body_bytes=args.max_request_body_bytes,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            responses_store_size=args.responses_store_size,
        )
        logger.info(
            "serving %s (%s) at http://%s:%d", name, engine.model_path, args.host, args.port
        )
        uvicorn_config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            # a backstop: the drain timer fails what is left first
            timeout_graceful_shutdown=args.drain_timeout + 2.0,
        )
        server = _DrainingServer(
            uvicorn_config, engine, args.drain_timeout, stop_engine=config.nnodes > 1
        )

        def on_fatal(error: BaseException) -> None:
            logger.critical("the engine cannot go on, shutting the server down: %s", error)
            # The requests in flight have ended with the error already. For a moment /health
            # answers 503 (a probe sees why), then the server stops and exits non-zero.
            stop = threading.Timer(FATAL_GRACE_S, setattr, args=(server, "should_exit", True))
            stop.daemon = True
            stop.start()
            # A backstop: a rank stuck in a collective (NCCL) must not hold the process.
            timer = threading.Timer(args.drain_timeout + 10.0, os._exit, args=(1,))
            timer.daemon = True
            timer.start()

        engine.add_fatal_hook(on_fatal)
        server.run()
    finally:
        # The engine thread may be inside a long step: do not wait for it (it is a daemon).
        engine.shutdown(timeout=1.0)
    if engine.fatal_error is not None:
        logger.error("exiting: %s", engine.fatal_error)
        # Now, not through the interpreter's exit: a rank stuck in a collective with the dead
        # one (NCCL) could hold a finalizer forever, and an orchestrator waits for this exit.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0
