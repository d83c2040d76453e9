"""POST /v1/completions: one or more prompts, each with n choices (sampled, or a beam search's best); whole or
streamed."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from fasterllm.entrypoints.openai.protocol import CompletionRequest, OpenAIError, usage
from fasterllm.entrypoints.openai.serving_common import (
    DeltaTracker,
    OpenAIServing,
    StreamChunks,
    ranked_logprobs,
)
from fasterllm.outputs import SampleLogprobs


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, base_id: str) -> dict[str, Any] | StreamingResponse:
        """The response body, or a stream of server-sent events when request.stream is set."""
        arrival = time.time()
        self.check_request(request)
        if request.echo or request.suffix is not None:
            raise OpenAIError(400, "echo and suffix are not supported by this server; leave them unset",
                              "echo" if request.echo else "suffix")
        if request.stream and request.best_of is not None and request.best_of != request.n:
            raise OpenAIError(400, f"best_of={request.best_of} must equal n={request.n} when streaming (the best "
                                   "samples are only known at the end); drop best_of or stream=false", "best_of")
        prompts = self.llm.inputs.generation_prompts(request.prompt)
        params = self.request_params(request, request.max_tokens, request.logprobs, request.best_of)
        for prompt in prompts:
            self.llm.inputs.check_generation_length(len(prompt), request.max_tokens, "prompt", "max_tokens")
        request_ids = await self.start(request, base_id, prompts, params, arrival)
        created = int(arrival)
        if request.stream:
            return self.stream_response(base_id, request_ids, self._chunks(request, base_id, created, request_ids))
        finals = await self.final_outputs(request_ids)
        choices, completion_tokens = [], 0
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                choices.append(_choice(prompt_index * request.n + completion.index, completion.text,
                                       completion.finish_reason, _logprobs(completion.logprobs, request.logprobs, 0)))
        prompt_tokens = sum(len(p) for p in prompts)
        return {"id": base_id, "object": "text_completion", "created": created, "model": self.served_model_name,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def _chunks(self, request: CompletionRequest, base_id: str, created: int,
                      request_ids: list[str]) -> AsyncIterator[dict[str, Any]]:
        chunks = StreamChunks(request, base_id, "text_completion", created, self.served_model_name)
        trackers = [DeltaTracker() for _ in request_ids]
        text_offsets: dict[int, int] = {}
        prompt_tokens = completion_tokens = 0
        async for prompt_index, output in self.merged_outputs(request_ids):
            choices = []
            for delta in trackers[prompt_index].deltas(output):
                index = prompt_index * request.n + delta.index
                offset = text_offsets.get(index, 0)
                choices.append(_choice(index, delta.text, delta.finish_reason,
                                       _logprobs(delta.logprobs, request.logprobs, offset)))
                text_offsets[index] = offset + len(delta.text)
            if output.finished:  # an encoder-decoder model's prompt is its encoder input
                prompt_tokens += len(output.encoder_prompt_token_ids or output.prompt_token_ids)
                completion_tokens += sum(len(c.token_ids) for c in output.outputs)
            if choices:
                yield chunks.chunk(choices)
        if chunks.include_usage:
            yield chunks.usage_chunk(prompt_tokens, completion_tokens)


def _choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _logprobs(logprobs: SampleLogprobs | None, num_top: int | None, text_offset: int) -> dict[str, Any] | None:
    """The completions API's logprobs object; text_offset is where these tokens start in the choice's text."""
    if logprobs is None or num_top is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for sampled, top in ranked_logprobs(logprobs, num_top):
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        top_logprobs.append({lp.decoded_token: lp.logprob for lp in top})
        offsets.append(text_offset)
        text_offset += len(sampled.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}

