"""POST /v1/chat/completions: the model's chat template around the messages; sampled or beam search; whole or
streamed; tool calls (tool_calls.py) read from the answer."""
from __future__ import annotations

import dataclasses
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
from fasterllm.entrypoints.openai.tool_calls import parse_tool_calls, tool_mode, tool_schema
from fasterllm.outputs import CompletionOutput, SampleLogprobs
from fasterllm.sampling_params import SamplingParams, StructuredOutputsParams


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
        mode = tool_mode(request)
        prompt = self._render(request, mode)
        params = self._constrain_to_tools(request, mode, self.request_params(request, max_tokens, num_logprobs))
        self.llm.inputs.check_generation_length(len(prompt), max_tokens, "messages", max_field)
        request_ids = await self.start(request, request_id, [prompt], params, arrival)
        created = int(arrival)
        if request.stream:
            return self.stream_response(request_id, request_ids,
                                        self._chunks(request, request_id, created, request_ids, mode))
        (output,) = await self.final_outputs(request_ids)
        choices = []
        for completion in output.outputs:
            message, finish_reason = _message(completion, mode, request)
            choices.append({"index": completion.index, "message": message,
                            "logprobs": _logprobs(completion.logprobs, num_logprobs), "finish_reason": finish_reason})
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        return {"id": request_id, "object": "chat.completion", "created": created, "model": self.served_model_name,
                "choices": choices, "usage": usage(len(prompt), completion_tokens)}

    @staticmethod
    def _constrain_to_tools(request: ChatCompletionRequest, mode: str | None, params):
        """A named function or "required": the output follows the tool-call schema (and no other constraint)."""
        schema = tool_schema(request, mode)
        if schema is None:
            return params
        if not isinstance(params, SamplingParams):
            raise OpenAIError(400, "tool_choice 'required' or a named function cannot run as a beam search; drop "
                                   "use_beam_search", "tool_choice")
        if params.structured_outputs is not None:
            raise OpenAIError(400, "tool_choice constrains the output to a tool call, and the request constrains it "
                                   "again (response_format or structured outputs); use one of them", "tool_choice")
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))

    def _render(self, request: ChatCompletionRequest, mode: str | None) -> list[int]:
        messages = []
        for message in request.messages:
            content = message.content
            if isinstance(content, list):  # text parts, joined as the model sees one text
                content = "".join(part.text for part in content)
            messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
        # the template shows the model its tools (a template without tool support ignores them)
        tools = {"tools": [tool.model_dump(exclude_none=True) for tool in request.tools]} if mode else {}
        try:
            return self.llm.tokenizer.encode_chat(messages, request.add_generation_prompt, **tools)
        except (ValueError, TemplateError) as exc:
            raise OpenAIError(400, f"messages could not be rendered with the model's chat template: {exc}",
                              "messages") from None

    async def _chunks(self, request: ChatCompletionRequest, request_id: str, created: int,
                      request_ids: list[str], mode: str | None) -> AsyncIterator[dict[str, Any]]:
        """Content deltas as they come; with tools, each choice's message once it is finished (whether the text
        is a tool call is known only then), as one delta of content or of tool_calls."""
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        chunks = StreamChunks(request, request_id, "chat.completion.chunk", created, self.served_model_name)
        yield chunks.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(request.n)])
        tracker = DeltaTracker()
        sent: set[int] = set()  # with tools: the choices whose message went out
        final = None
        async for _, output in self.merged_outputs(request_ids):
            if mode is not None:
                finished = [c for c in output.outputs if c.finish_reason is not None and c.index not in sent]
                sent.update(c.index for c in finished)
                choices = [_tool_delta(completion, mode, request) for completion in finished]
            else:
                choices = [{"index": d.index, "delta": {"content": d.text} if d.text else {},
                            "logprobs": _logprobs(d.logprobs, num_logprobs), "finish_reason": d.finish_reason}
                           for d in tracker.deltas(output)]
            if choices:
                yield chunks.chunk(choices)
            final = output
        if chunks.include_usage and final is not None:
            yield chunks.usage_chunk(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs))


def _message(completion: CompletionOutput, mode: str | None,
             request: ChatCompletionRequest) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished completion, its tool calls parsed out, and its finish reason."""
    if mode is None or (mode != "auto" and completion.finish_reason == "length"):  # a cut-off call: plain text
        return {"role": "assistant", "content": completion.text}, completion.finish_reason
    content, calls = parse_tool_calls(completion.text, mode, [tool.function.name for tool in request.tools])
    if not calls:
        return {"role": "assistant", "content": content}, completion.finish_reason
    return ({"role": "assistant", "content": content, "tool_calls": [call.as_openai() for call in calls]},
            "tool_calls")


def _tool_delta(completion: CompletionOutput, mode: str, request: ChatCompletionRequest) -> dict[str, Any]:
    message, finish_reason = _message(completion, mode, request)
    delta = {"content": message["content"]} if message["content"] else {}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    return {"index": completion.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _logprobs(logprobs: SampleLogprobs | None, num_top: int | None) -> dict[str, Any] | None:
    """The chat API's logprobs object: per token, its logprob and the num_top most likely alternatives."""
    if logprobs is None or num_top is None:
        return None

    def item(lp) -> dict[str, Any]:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(sampled), "top_logprobs": [item(lp) for lp in top]}
                        for sampled, top in ranked_logprobs(logprobs, num_top)]}
