"""The OpenAI-compatible HTTP server: the FastAPI app and its uvicorn runner (`fasterllm serve`).

It serves one generate model (completions, chat) and, with --embedding-model, an embeddings model
as well, on an EmbeddingEngine of its own (/v1/embeddings)."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from fasterllm.config import EngineArgs
from fasterllm.engine.async_engine import AsyncLLM
from fasterllm.engine.embedding_engine import EmbeddingEngine
from fasterllm.entrypoints.openai.metrics import ServerMetrics
from fasterllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                                   OpenAIError, error_body)
from fasterllm.entrypoints.openai.serving_chat import OpenAIServingChat
from fasterllm.entrypoints.openai.serving_common import as_openai_error
from fasterllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fasterllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding

logger = logging.getLogger("fasterllm")


def build_app(llm: AsyncLLM, served_model_name: str | None = None, api_key: str | None = None,
              embedding_engine: EmbeddingEngine | None = None) -> FastAPI:
    """The app around a (not yet started) AsyncLLM; its engine loop runs while the app does.

    embedding_engine: serve /v1/embeddings with it (under its own model name); without it that route says how."""
    served_model_name = served_model_name or llm.model_name
    metrics = ServerMetrics()
    completions = OpenAIServingCompletion(llm, served_model_name, metrics)
    chat = OpenAIServingChat(llm, served_model_name, metrics)
    embeddings = OpenAIServingEmbedding(embedding_engine) if embedding_engine is not None else None
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.start()
        yield
        llm.shutdown()

    app = FastAPI(title="fasterllm OpenAI-compatible server", lifespan=lifespan)

    def error_response(error: OpenAIError) -> JSONResponse:
        metrics.requests.labels("rejected" if error.status < 500 else "error").inc()
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key, on_reject=error_response)

    @app.get("/health")
    async def health() -> Response:
        if llm.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(503, f"The engine is not running: {llm.dead_reason}"), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(llm.stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = [(served_model_name, llm.max_model_len)]
        if embedding_engine is not None:
            served.append((embeddings.model_name, embedding_engine.max_model_len))
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "fasterllm",
                                            "max_model_len": max_model_len} for name, max_model_len in served]}

    async def respond(raw: Request, request_id: str, create: Awaitable) -> Response:
        """Run one generation request; a client that disconnects before the reply cancels (aborts) it."""
        work = asyncio.ensure_future(create)
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()  # closes its output streams, which aborts its engine requests
            metrics.requests.labels("aborted").inc()
            return Response(status_code=499)
        try:
            result = work.result()
        except Exception as exc:
            return error_response(as_openai_error(exc, request_id))
        if isinstance(result, Response):  # a stream: it counts its own outcome
            return result
        metrics.requests.labels("success").inc()
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await respond(raw, request_id, completions.create(request, request_id))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await respond(raw, request_id, chat.create(request, request_id))

    @app.post("/v1/embeddings")
    async def create_embeddings(request: EmbeddingRequest) -> Response:
        if embeddings is None:
            return error_response(OpenAIError(
                404, "This server has no embeddings model: start it with `fasterllm serve --embedding-model default` "
                     "(all-MiniLM-L6-v2) or `--embedding-model PATH` (an encoder directory, or a LLaMA-family "
                     "decoder: .gguf or directory)", "model"))
        try:
            result = await embeddings.create(request)
        except Exception as exc:
            return error_response(as_openai_error(exc, f"embd-{uuid.uuid4().hex}"))
        metrics.requests.labels("success").inc()
        return JSONResponse(result)

    return app


class _ApiKeyMiddleware:
    """Requests under /v1 need 'Authorization: Bearer <api_key>' (pure ASGI: streams and disconnects pass as they are)."""

    def __init__(self, app, api_key: str, on_reject) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = self.on_reject(OpenAIError(401, "Missing or wrong API key: send the header "
                                                           "'Authorization: Bearer <key>' with the server's --api-key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _disconnected(raw: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """One 400 naming each bad field; a value that fits none of a field's types lists the accepted ones."""
    by_field: dict[str, list[dict]] = {}
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            return _not_json(detail)
        loc = [str(part) for part in error.get("loc", ())[1:]]
        if not loc and isinstance(error.get("input"), bytes):  # FastAPI parses JSON only when the header says so
            return _unparsed_body_error(error["input"])
        by_field.setdefault(loc[0] if loc else "body", []).append({**error, "loc": loc})
    messages = []
    for field, errors in by_field.items():
        if len(errors) > 1 and all(len(e["loc"]) == 2 for e in errors):  # a union: loc[1] names the member type
            types = " | ".join(e["loc"][1] for e in errors)
            messages.append(f"{field}: {_shown(errors[0].get('input'))} is none of the accepted types ({types})")
        else:
            messages.extend(f"{'.'.join(e['loc']) or field}: {e.get('msg')} (got {_shown(e.get('input'))})"
                            for e in errors)
    return OpenAIError(400, "Invalid request: " + "; ".join(messages), next(iter(by_field)))


def _not_json(detail: object) -> OpenAIError:
    return OpenAIError(400, f"The request body is not valid JSON: {detail}; send a JSON object")


def _unparsed_body_error(body: bytes) -> OpenAIError:
    try:
        json.loads(body)
    except ValueError as exc:
        return _not_json(exc)
    return OpenAIError(400, "The request body is JSON but came without the header 'Content-Type: application/json'; "
                            "send that header with it")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class ServeOptions:
    """What `fasterllm serve` takes besides the engine's arguments.

    embedding_model: also serve /v1/embeddings with this model ("default": the embedded all-MiniLM-L6-v2), on the
    generate model's device and dtype, quantized with embedding_quantization (the engine's quantization is the
    generate model's: an encoder would refuse it). api_server_count: HTTP server processes in front of the one
    engine process (api_servers.py)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    shutdown_timeout_s: float = 30.0
    embedding_model: str | None = None
    embedding_quantization: str | None = None
    api_server_count: int = 1

    def check(self) -> None:
        if self.embedding_quantization is not None and self.embedding_model is None:
            raise ValueError(f"embedding_quantization={self.embedding_quantization!r} has no model to quantize; give "
                             "--embedding-model too, or leave --embedding-quantization out")
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count {self.api_server_count}: must be 1 or more")


def run_server(engine_args: EngineArgs, options: ServeOptions = ServeOptions()) -> None:
    """Load the model(s), then serve until SIGINT/SIGTERM; in-flight requests get options.shutdown_timeout_s to
    finish."""
    options.check()
    if options.api_server_count > 1:
        from fasterllm.entrypoints.openai.api_servers import run_api_servers

        run_api_servers(engine_args, options)
        return
    embedding_engine = load_embedding_engine(engine_args, options)  # first: a bad setting fails in seconds
    llm = AsyncLLM.from_engine_args(engine_args)
    logger.warning("serving %s on http://%s:%d/v1", options.served_model_name or llm.model_name, options.host,
                   options.port)
    serve_app(llm, embedding_engine, options)


def load_embedding_engine(engine_args: EngineArgs, options: ServeOptions) -> EmbeddingEngine | None:
    if options.embedding_model is None:
        return None
    model = None if options.embedding_model == "default" else options.embedding_model
    return EmbeddingEngine(EngineArgs(model=model, task="embed", device=engine_args.device, dtype=engine_args.dtype,
                                      quantization=options.embedding_quantization))


def serve_app(llm: AsyncLLM, embedding_engine: EmbeddingEngine | None, options: ServeOptions,
              listening: socket.socket | None = None) -> None:
    """Serve the app around llm until SIGINT/SIGTERM, on options' host and port, or on a socket that listens
    already (several API server processes share one)."""
    app = build_app(llm, options.served_model_name, options.api_key, embedding_engine)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                            timeout_graceful_shutdown=options.shutdown_timeout_s)
    uvicorn.Server(config).run(sockets=None if listening is None else [listening])
