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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvloop.engine.async_engine import AsyncEngine
from kvloop.engine.client import EngineClient
from kvloop.engine.live import LiveFeed
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.steps import StepObservers
from kvloop.engine.trace import TraceRecorder
from kvloop.roofline import Machine
from kvloop.server.connections import DEFAULT_MAX_HEADER_BYTES
from kvloop.server.errors import APIError, bad_request, from_validation_error
from kvloop.server.live import COOKIE as LIVE_COOKIE
from kvloop.server.live import add_live_routes, is_page_path, page_token
from kvloop.server.metrics import ServerMetrics
from kvloop.server.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    CrashGuardMiddleware,
)
from kvloop.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    SafeJSONResponse,
)
from kvloop.server.serving import DEFAULT_MAX_PROMPTS, DEFAULT_MAX_TOKENS, OpenAIServing

logger = logging.getLogger("kvloop.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_WAITING = 256


@dataclass(frozen=True)
class ServerSettings:
    model_name: str | None = None  # defaults to the checkpoint's name
    api_key: str | None = None  # None: /v1 is open (bind to loopback then)
    max_waiting: int | None = DEFAULT_MAX_WAITING  # sequences queued before 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS  # a longer prompt list is a 400
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # chat without max_tokens (capped by room)
    # The connection side, read by kvloop.server.lifecycle (not by the app):
    shutdown_grace: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    header_timeout: float = 10.0  # a request's headers must arrive within this
    body_timeout: float = 30.0  # and its body within this, once the headers are in
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int | None = 1024  # open connections; more are refused with 503
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # larger request heads get 431


def create_app(engine: LLMEngine | EngineClient, settings: ServerSettings | None = None,
               trace: TraceRecorder | None = None, machine: Machine | None = None) -> FastAPI:
    """An app that owns `engine` through an AsyncEngine thread (or any EngineClient, such
    as kvloop.cluster's replicas), started and stopped with the app's lifespan. `kvloop
    serve` passes an AsyncEngine.build one (the model loaded on the thread that runs it:
    see there why that matters for speed).

    `trace`: records the engine's steps from now on, and is written to its file when the
    server shuts down, once the engine has stopped. `machine`: the measured FLOP/s and
    bandwidth the live page's roofline gauge compares each step with (None: "not
    measured")."""
    settings = settings or ServerSettings()
    async_engine: EngineClient
    if isinstance(engine, LLMEngine):
        async_engine = AsyncEngine(engine, settings.max_waiting)
    else:  # an AsyncEngine, or replicas behind a router (kvloop.cluster): the same face
        async_engine, engine = engine, engine.engine
        async_engine.max_waiting = settings.max_waiting
    # The live page's feed watches every step (a few dict updates; see kvloop.engine.live)
    # beside the trace and any observer the caller attached. The engine has no request
    # yet: nothing is missed.
    feed = LiveFeed(engine.kv_block_map, machine)
    watchers = [o for o in (engine.observer, trace) if o is not None]
    engine.observer = StepObservers(*watchers, feed) if watchers else feed
    model_name = settings.model_name or engine.checkpoint.name
    metrics = ServerMetrics(async_engine.stats, async_engine.replica_loads)
    async_engine.observer = metrics
    serving = OpenAIServing(async_engine, model_name, settings.max_prompts_per_request,
                            settings.default_max_tokens)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s (context %d tokens, weights %s)", model_name,
                    engine.max_model_len, engine.config.quantization)
        try:
            yield
        finally:
            async_engine.shutdown()
            if trace is not None:
                _write_trace(trace)

    app = FastAPI(title="kvloop", version="0.1.0", lifespan=lifespan,
                  default_response_class=SafeJSONResponse)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.serving = serving  # the shutdown drain reaches the live jobs through it
    app.state.settings = settings

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

    # Added first = innermost: a handler's bug is caught below Starlette's server-error
    # layer, which would log it again and re-raise it for uvicorn to log a third time.
    app.add_middleware(CrashGuardMiddleware)
    # Added last = outermost: the key is checked before a byte of the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key,
                           page_paths=is_page_path, cookie=LIVE_COOKIE,
                           page_token=page_token(settings.api_key), login_path="/live/login")

    # -- routes -------------------------------------------------------------------------------
    @app.get("/health", responses={200: {"content": {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"type": "string"}},
        "required": ["status"]}}}}, 503: _ERROR})
    async def health() -> Response:
        if serving.draining:  # a load balancer should stop sending work here now
            return APIError(503, "the server is shutting down", "service_unavailable",
                            code="shutting_down").response()
        if async_engine.healthy:
            return JSONResponse({"status": "ok"})
        why = async_engine.error
        return APIError(503, f"the engine loop is not running ({why!r})" if why
                        else "the engine loop is not running", "service_unavailable",
                        code="engine_dead").response()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", responses=_v1_responses(CompletionResponse))
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", responses=_v1_responses(ChatCompletionResponse))
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    kv = engine.stats().kv
    add_live_routes(app, feed, {
        "model": model_name, "max_model_len": engine.max_model_len,
        "num_blocks": kv.num_blocks, "block_size": engine.config.block_size,
        "bytes_per_block": kv.bytes_per_block, "kv_dtype": kv.kv_dtype,
        "api_key_required": settings.api_key is not None,
        "machine": None if machine is None else {"flops": machine.flops,
                                                 "bandwidth": machine.bandwidth}},
        draining=lambda: serving.draining, api_key=settings.api_key)
    app.state.live_feed = feed

    _document_real_responses(app)
    return app


# --- the OpenAPI document says what the server really answers ------------------------------------
_ERROR: dict[str, Any] = {"model": ErrorResponse}
_V1_ERRORS = {
    400: "invalid request (the error names the field in `param`)",
    401: "missing or invalid API key (when the server has one)",
    413: "request body too large",
    429: "too many sequences waiting; retry after Retry-After seconds",
    503: "the engine is not running, or the server is shutting down",
}


def _v1_responses(model: type) -> dict[int | str, dict[str, Any]]:
    # With stream: true, server-sent events; the schema describes one event, as OpenAPI
    # before 3.2 reads it: its data is a JSON chunk, an error object, or [DONE].
    event = {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string", "contentMediaType": "application/json"},
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
    ok: dict[str, Any] = {"model": model, "content": {"text/event-stream": {"schema": event}}}
    return {200: ok, **{code: {**_ERROR, "description": why} for code, why in _V1_ERRORS.items()}}


def _document_real_responses(app: FastAPI) -> None:
    """FastAPI documents a 422 for every route with a body and nothing else; this server
    answers 400 (in the OpenAI shape) instead and adds its own statuses."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path_item in doc.get("paths", {}).values():
            for op in path_item.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _write_trace(trace: TraceRecorder) -> None:
    """At shutdown: a file that cannot be written is logged; the exit stays clean."""
    try:
        trace.write()
    except OSError as e:
        logger.error("cannot write the trace %s: %s", trace.path, e.strerror or e)
        return
    logger.info("trace of %d engine steps written to %s", trace.num_steps, trace.path)
