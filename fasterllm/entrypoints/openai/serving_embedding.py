"""POST /v1/embeddings: an OpenAI embeddings request body in, the OpenAI response body out.

The server mounts create_embedding on an EmbeddingEngine (LLM(task="embed")'s engine). It is
synchronous (one packed forward pass per token budget); call it off the event loop, one at a time.
"""
from __future__ import annotations

import base64
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fasterllm.engine.embedding_engine import EmbeddingEngine
from fasterllm.entrypoints.openai.protocol import OpenAIError


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM's extension: -1 keeps the last max_model_len tokens, k the last k; unset, a longer input is an error
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)


def create_embedding(engine: EmbeddingEngine, body: dict[str, Any], served_model_name: str | None = None
                     ) -> dict[str, Any]:
    """Raises OpenAIError (status 400 and the offending field) for a bad request; nothing runs then."""
    try:
        request = EmbeddingRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        raise OpenAIError(400, f"Invalid embeddings request: {param}: {first['msg']}", param) from exc
    if request.dimensions is not None and request.dimensions != engine.embedding_dim:
        raise OpenAIError(400, f"dimensions={request.dimensions} is not available: {engine.model_name} makes "
                          f"{engine.embedding_dim}-dimensional vectors only; leave dimensions out", "dimensions")
    inputs = _input_list(request.input)
    try:
        token_ids = engine.tokenize(inputs, request.truncate_prompt_tokens)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), "input") from exc
    vectors = engine.embed(token_ids)
    if request.encoding_format == "base64":  # little-endian float32 bytes, as OpenAI sends them
        encoded = [base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii") for row in vectors]
    else:
        encoded = vectors.tolist()
    num_tokens = sum(len(ids) for ids in token_ids)
    return {"object": "list", "model": served_model_name or engine.model_name,
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
