"""The FastAPI application: OpenAI-compatible endpoints, the Anthropic Messages endpoint and
named cached contents over one AsyncLLM. The one module that mounts the dialects' routes
(tests/entrypoints/server/test_server_layers.py keeps every other module off them)."""
from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefixserve.diagnose.live import MissExplainer
from prefixserve.engine import AsyncLLM, EngineClient, LLMEngine
from prefixserve.entrypoints.server.anthropic.count_tokens import count_tokens
from prefixserve.entrypoints.server.anthropic.messages import create_message
from prefixserve.entrypoints.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from prefixserve.entrypoints.server.cached_contents import (CachedContentCreate, CachedContentUpdate,
                                                            create_cached_content, delete_cached_content,
                                                            get_cached_content, list_cached_contents,
                                                            update_cached_content)
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.errors import APIError, install_error_handlers
from prefixserve.entrypoints.server.gate import Gate
from prefixserve.entrypoints.server.metrics import ServerMetrics
from prefixserve.entrypoints.server.openai.chat import create_chat_completion
from prefixserve.entrypoints.server.openai.completions import create_completion
from prefixserve.entrypoints.server.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                            DetokenizeRequest, ModelCard, ModelList,
                                                            TokenizeRequest)
from prefixserve.entrypoints.server.openai.tokenize import detokenize, tokenize
from prefixserve.entrypoints.server.prompting.bodies import add_body_schemas, request_body_schema
from prefixserve.entrypoints.server.prompting.render_pool import RenderPool
from prefixserve.entrypoints.server.request_log import RequestLog
from prefixserve.entrypoints.server.responses.create import create_response
from prefixserve.entrypoints.server.responses.protocol import ResponsesRequest
from prefixserve.entrypoints.server.responses.stored import delete_response, get_response, list_input_items
from prefixserve.entrypoints.server.state import ServerState, get_state

logger = logging.getLogger(__name__)


def build_app(engine: Union[LLMEngine, AsyncLLM], config: ServerConfig = ServerConfig()) -> FastAPI:
    """An app serving `engine`.

    Given an LLMEngine, the app wraps it in an AsyncLLM bounded by
    config.max_waiting, starts its loop on startup and stops it on shutdown.
    Given an AsyncLLM, the app starts it if needed and leaves stopping it (and
    its own max_waiting) to the caller.
    """
    owned = isinstance(engine, LLMEngine)
    async_llm = AsyncLLM(engine, max_waiting=config.max_waiting) if owned else engine
    # Or another front over engines (replicas/front.py: ReplicatedLLM).
    if not isinstance(async_llm, EngineClient):
        raise TypeError(f"build_app needs an LLMEngine or AsyncLLM, got {type(engine).__name__}")
    model_name = config.served_model_name or async_llm.info.model
    state = ServerState(async_llm=async_llm, config=config, model_name=model_name,
                        metrics=ServerMetrics(async_llm.stats, model_name,
                                              config.keys.tenants if config.keys is not None else frozenset()),
                        explainer=MissExplainer(async_llm.tokenizer.decode,
                                                max_requests=config.diagnose_max_requests),
                        renderer=RenderPool(async_llm.info.model, max_tokens=async_llm.max_model_len,
                                           timeout_s=config.render_timeout_s, vision=async_llm.info.vision),
                        request_log=(RequestLog(config.request_log, config.request_log_max_bytes)
                                     if config.request_log is not None else None))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_llm.start()
        state.renderer.warm_up()
        try:
            yield
        finally:
            state.renderer.shutdown()
            if state.request_log is not None:
                state.request_log.close()
            if owned:
                async_llm.shutdown()

    app = FastAPI(title="prefixserve", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(Gate, keys=config.keys, max_body_bytes=config.max_body_bytes)
    if config.keys is None:
        logger.warning("no API keys configured: every client is one tenant and may see, use and "
                       "delete what any other client cached; start with --api-key or --api-keys "
                       "to separate tenants")

    # JSON, or server-sent events when the request asks to stream
    streamed = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}
    # Bodies are parsed by bodies.py (in the render process when large), not by FastAPI, so
    # their schemas are declared here.
    body = request_body_schema
    app.post("/v1/completions", responses=streamed, openapi_extra=body(CompletionRequest))(create_completion)
    app.post("/v1/chat/completions", responses=streamed,
             openapi_extra=body(ChatCompletionRequest))(create_chat_completion)
    app.post("/v1/messages", responses=streamed, openapi_extra=body(MessagesRequest))(create_message)
    app.post("/v1/messages/count_tokens", openapi_extra=body(CountTokensRequest))(count_tokens)
    app.post("/tokenize", openapi_extra=body(TokenizeRequest))(tokenize)
    app.post("/detokenize", openapi_extra=body(DetokenizeRequest))(detokenize)
    app.post("/v1/responses", responses=streamed, openapi_extra=body(ResponsesRequest))(create_response)
    app.get("/v1/responses/{response_id}")(get_response)
    app.delete("/v1/responses/{response_id}")(delete_response)
    app.get("/v1/responses/{response_id}/input_items")(list_input_items)
    app.post("/v1/cached_contents", openapi_extra=body(CachedContentCreate))(create_cached_content)
    app.get("/v1/cached_contents")(list_cached_contents)
    app.get("/v1/cached_contents/{key}")(get_cached_content)
    app.patch("/v1/cached_contents/{key}", openapi_extra=body(CachedContentUpdate))(update_cached_content)
    openapi = app.openapi

    def openapi_with_bodies() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_body_schemas(openapi(), [CompletionRequest, ChatCompletionRequest,
                                                              MessagesRequest, ResponsesRequest,
                                                              CountTokensRequest, TokenizeRequest,
                                                              DetokenizeRequest, CachedContentCreate,
                                                              CachedContentUpdate])
        return app.openapi_schema
    app.openapi = openapi_with_bodies
    app.delete("/v1/cached_contents/{key}")(delete_cached_content)

    def model_card(s: ServerState) -> ModelCard:
        return ModelCard(id=s.model_name, created=s.created, max_model_len=s.async_llm.max_model_len)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card(get_state(request))]).model_dump())

    # {model_id:path}: served names may hold slashes (Qwen/Qwen3-8B)
    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
        s = get_state(request)
        if model_id != s.model_name:
            raise APIError(404, f"The model {model_id[:200]!r} does not exist; this server serves "
                                f"{s.model_name!r}", type="not_found_error", param="model",
                           code="model_not_found")
        return JSONResponse(model_card(s).model_dump())

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        s = get_state(request)
        if not s.async_llm.is_running:
            reason = s.async_llm.dead_reason or "the engine loop is not running"
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        kernels = {name: {"active": k["active"], "reason": k["reason"]}
                   for name, k in s.async_llm.info.kernels.items()}
        info = s.async_llm.info
        return JSONResponse({"status": "ok", "dtype": info.dtype, "dtype_reason": info.dtype_reason,
                             "kv_layout": info.kv_layout, "kernels": kernels})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(get_state(request).metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        dropped = await get_state(request).async_llm.reset_prefix_cache()
        return JSONResponse({"dropped_blocks": dropped})

    return app
