"""The FastAPI app: routes, error shapes, gates. Behaviour lives in the engine; the
translation in serving.py.

    app = create_app(LLMEngine(model), ServerSettings(api_key="..."))
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvloop.engine.async_engine import AsyncEngine
from kvloop.engine.llm_engine import LLMEngine
from kvloop.server.errors import APIError, bad_request, from_validation_error
from kvloop.server.metrics import ServerMetrics
from kvloop.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from kvloop.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from kvloop.server.serving import OpenAIServing

logger = logging.getLogger("kvloop.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_WAITING = 256


@dataclass(frozen=True)
class ServerSettings:
    model_name: str | None = None  # defaults to the checkpoint's name
    api_key: str | None = None  # None: /v1 is open (bind to loopback then)
    max_waiting: int | None = DEFAULT_MAX_WAITING  # sequences queued before 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def create_app(engine: LLMEngine, settings: ServerSettings | None = None) -> FastAPI:
    """An app that owns `engine` through an AsyncEngine thread, started and stopped with
    the app's lifespan."""
    settings = settings or ServerSettings()
    model_name = settings.model_name or engine.checkpoint.name
    async_engine = AsyncEngine(engine, settings.max_waiting)
    metrics = ServerMetrics(async_engine.stats)
    async_engine.observer = metrics
    serving = OpenAIServing(async_engine, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s (context %d tokens)", model_name, engine.max_model_len)
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="kvloop", version="0.1.0", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    # -- errors: always the OpenAI shape ------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type.lower():
            # FastAPI only parses JSON bodies; `curl -d` alone sends a form type.
            return bad_request(f"send the body as JSON with Content-Type: application/json "
                               f"(got {content_type or 'no Content-Type'})",
                               code="invalid_content_type").response()
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind,
                        headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> Response:
        # A bug in a handler is one failed request, never a dead server.
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc!r}", "internal_error").response()

    # Added last = outermost: the key is checked before a byte of the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)

    # -- routes -------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if async_engine.healthy:
            return JSONResponse({"status": "ok"})
        why = async_engine.error
        return APIError(503, f"the engine loop is not running ({why!r})" if why
                        else "the engine loop is not running", "service_unavailable",
                        code="engine_dead").response()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    return app
