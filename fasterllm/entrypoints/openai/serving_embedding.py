"""POST /v1/embeddings: an OpenAI embeddings request (validated by FastAPI against protocol.EmbeddingRequest) in,
the OpenAI response body out.

`fasterllm serve --embedding-model` loads an EmbeddingEngine (LLM(task="embed")'s engine) next to
the generate engine, and OpenAIServingEmbedding mounts create_embedding on it. create_embedding is
synchronous (one packed forward pass per token budget), so the server runs it on a worker thread,
one request at a time: the event loop and the generate engine's thread go on meanwhile.
"""
from __future__ import annotations

import asyncio
import base64
from typing import Any

from fasterllm.engine.embedding_engine import EmbeddingEngine
from fasterllm.entrypoints.openai.protocol import EmbeddingRequest, OpenAIError
from fasterllm.entrypoints.openai.serving_common import invalid_request


class OpenAIServingEmbedding:
    """The server's embeddings model: requests name it (or no model) and run one at a time, off the event loop."""

    def __init__(self, engine: EmbeddingEngine):
        self.engine = engine
        self.model_name = engine.model_name
        self._lock = asyncio.Lock()  # the engine is not thread-safe

    async def create(self, request: EmbeddingRequest) -> dict[str, Any]:
        if request.model is not None and request.model != self.model_name:
            raise OpenAIError(404, f"The model {request.model!r} does not make embeddings on this server; its "
                                   f"embeddings model is {self.model_name!r} (see GET /v1/models)", "model")
        async with self._lock:
            return await asyncio.to_thread(create_embedding, self.engine, request)


def create_embedding(engine: EmbeddingEngine, request: EmbeddingRequest) -> dict[str, Any]:
    """Raises OpenAIError (status 400 and the offending field) for a request the engine refuses; nothing runs then."""
    if request.dimensions is not None and request.dimensions != engine.embedding_dim:
        raise OpenAIError(400, f"dimensions={request.dimensions} is not available: {engine.model_name} makes "
                          f"{engine.embedding_dim}-dimensional vectors only; leave dimensions out", "dimensions")
    inputs = _input_list(request.input)
    try:
        token_ids = engine.tokenize(inputs, request.truncate_prompt_tokens)
    except ValueError as exc:  # "input 1: ..." or "truncate_prompt_tokens=..."
        raise invalid_request(exc, request) from exc
    vectors = engine.embed(token_ids)
    if request.encoding_format == "base64":  # little-endian float32 bytes, as OpenAI sends them
        encoded = [base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii") for row in vectors]
    else:
        encoded = vectors.tolist()
    num_tokens = sum(len(ids) for ids in token_ids)
    return {"object": "list", "model": engine.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _input_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError(400, "input is an empty list; send a string, a list of strings or token-id lists", "input")
    if all(isinstance(v, int) for v in value):
        return [list(value)]  # one input given as token ids
    return list(value)
