"""The OpenAI-compatible HTTP server: `build_app` (FastAPI) and `run_server` (`atom serve`).

Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`: 400 for
a request that is invalid (pydantic validation included: FastAPI's 422 becomes 400), 401 for a
missing or wrong API key on /v1/*, 404 for an unknown model or route, 500 for a bug. No request
can stop the server.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_engine import __version__
from atom_engine.server.async_engine import AsyncEngine
from atom_engine.server.metrics import ServerMetrics
from atom_engine.server.profiler import Profiler
from atom_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from atom_engine.server.serving_chat import create_chat_completion
from atom_engine.server.serving_common import APIError, ServerState
from atom_engine.server.serving_completion import create_completion

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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message for pydantic's errors, and the first offending field."""
    parts, param = [], None
    for error in exc.errors():
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if error.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {error.get('msg')}", None
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    *,
    profiler_dir: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` as `served_model_name` (also accepted: the model path)."""
    aliases = {engine.model_path, Path(engine.model_path).name}
    if engine.engine.config.model:
        aliases.add(engine.engine.config.model)
    state = ServerState(engine, served_model_name, frozenset(aliases), ServerMetrics(engine))
    profiler = Profiler(engine, profiler_dir)
    app = FastAPI(title="ATOM", version=__version__)
    app.state.atom = state
    _install_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
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

    app.include_router(v1)

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

    return app


def run_server(args) -> None:
    """`atom serve`: load the engine, then serve until interrupted."""
    import uvicorn

    from atom_engine.cli.args import engine_config_from_args

    config = engine_config_from_args(args)
    engine = AsyncEngine.from_config(config)
    name = args.served_model_name or args.model or Path(engine.model_path).stem
    try:
        app = build_app(engine, name, args.api_key, profiler_dir=args.profiler_dir)
        logger.info(
            "serving %s (%s) at http://%s:%d", name, engine.model_path, args.host, args.port
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        engine.shutdown()
