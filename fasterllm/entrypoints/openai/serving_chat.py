"""POST /v1/chat/completions: the model's chat template around the messages; sampled or beam search; whole or
streamed."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from jinja2 import TemplateError
from starlette.responses import StreamingResponse

from fasterllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIError,
    usage,
)
from fasterllm.entrypoints.openai.serving_common import (
    DeltaTracker,
    OpenAIServing,
    StreamChunks,
    ranked_logprobs,
)
from fasterllm.outputs import SampleLogprobs


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, request_id: str) -> dict[str, Any] | StreamingResponse:
        """The response body, or a stream of server-sent events when request.stream is set."""
        arrival = time.time()
        self.check_request(request)
        if self.llm.inputs.seq2seq is not None:
            raise OpenAIError(400, f"{self.served_model_name} is an encoder-decoder model, which has no chat template; "
                                   "send its input text to /v1/completions as the prompt", "messages")
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, f"top_logprobs={request.top_logprobs} needs logprobs=true", "top_logprobs")
        max_tokens, max_field = request.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, max_field = request.max_tokens, "max_tokens"
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        prompt = self._render(request)
        params = self.request_params(request, max_tokens, num_logprobs)
        self.llm.inputs.check_generation_length(len(prompt), max_tokens, "messages", max_field)
        request_ids = await self.start(request, request_id, [prompt], params, arrival)
        created = int(arrival)
        if request.stream:
            return self.stream_response(request_id, request_ids,
                                        self._chunks(request, request_id, created, request_ids))
        (output,) = await self.final_outputs(request_ids)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _logprobs(c.logprobs, num_logprobs), "finish_reason": c.finish_reason}
                   for c in output.outputs]
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        return {"id": request_id, "object": "chat.completion", "created": created, "model": self.served_model_name,
                "choices": choices, "usage": usage(len(prompt), completion_tokens)}

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        messages = []
        for message in request.messages:
            content = message.content
            if isinstance(content, list):  # text parts, joined as the model sees one text
                content = "".join(part.text for part in content)
            messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
        try:
            return self.llm.tokenizer.encode_chat(messages, request.add_generation_prompt)
        except (ValueError, TemplateError) as exc:
            raise OpenAIError(400, f"messages could not be rendered with the model's chat template: {exc}",
                              "messages") from None

    async def _chunks(self, request: ChatCompletionRequest, request_id: str, created: int,
                      request_ids: list[str]) -> AsyncIterator[dict[str, Any]]:
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        chunks = StreamChunks(request, request_id, "chat.completion.chunk", created, self.served_model_name)
        yield chunks.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(request.n)])
        tracker = DeltaTracker()
        final = None
        async for _, output in self.merged_outputs(request_ids):
            choices = [{"index": d.index, "delta": {"content": d.text} if d.text else {},
                        "logprobs": _logprobs(d.logprobs, num_logprobs), "finish_reason": d.finish_reason}
                       for d in tracker.deltas(output)]
            if choices:
                yield chunks.chunk(choices)
            final = output
        if chunks.include_usage and final is not None:
            yield chunks.usage_chunk(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs))


def _logprobs(logprobs: SampleLogprobs | None, num_top: int | None) -> dict[str, Any] | None:
    """The chat API's logprobs object: per token, its logprob and the num_top most likely alternatives."""
    if logprobs is None or num_top is None:
        return None

    def item(lp) -> dict[str, Any]:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(sampled), "top_logprobs": [item(lp) for lp in top]}
                        for sampled, top in ranked_logprobs(logprobs, num_top)]}
