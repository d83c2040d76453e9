"""What completions and chat completions share: checks, sampling or beam search params, running requests,
deltas, logprobs ranking, stream chunk envelopes, SSE."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from fasterllm.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from fasterllm.entrypoints.openai.metrics import ServerMetrics
from fasterllm.entrypoints.openai.protocol import OpenAIError, SamplingFields, usage
from fasterllm.entrypoints.openai.serving_beam_search import beam_search_params, check_beam_fields_unused
from fasterllm.outputs import Logprob, RequestOutput, SampleLogprobs
from fasterllm.errors import InvalidInputError
from fasterllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("fasterllm")


def as_openai_error(exc: Exception, request_id: str) -> OpenAIError:
    """The client's view of an exception raised while handling its request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):  # an InvalidInputError names its field; any other check has none to name
        return OpenAIError(400, str(exc), getattr(exc, "param", None))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"The engine is not running ({exc}); request {request_id} was not completed")
    if isinstance(exc, RequestFailedError):
        logger.error("request %s failed: %s", request_id, exc)
        return OpenAIError(500, f"Internal error while generating request {request_id}: {exc}")
    logger.exception("request %s failed unexpectedly", request_id)
    return OpenAIError(500, f"Internal error while handling request {request_id}: {exc!r}")


def invalid_request(exc: ValueError, request: BaseModel) -> OpenAIError:
    """A 400 for a ValueError that SamplingParams, BeamSearchParams or the engine raised on this request: its field
    is the error's param (InvalidInputError) when the request has a field of that name, else it names none."""
    param = getattr(exc, "param", None)
    if param is not None and param.startswith("structured_outputs") and isinstance(request, SamplingFields):
        param = next(iter(_constraint_sources(request)), param)  # the field the user wrote the constraint in
    return OpenAIError(400, str(exc), param if param in type(request).model_fields else None)


def ranked_logprobs(logprobs: SampleLogprobs, num_top: int) -> Iterator[tuple[Logprob, list[Logprob]]]:
    """Per token: the sampled token (each entry lists it first) and the num_top most likely tokens, by rank."""
    for entry in logprobs:
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        yield next(iter(entry.values())), top


class StreamChunks:
    """The fields around every streamed chunk's choices. With stream_options.include_usage each chunk carries
    "usage": null and a last chunk, with no choices, the totals (as OpenAI streams them)."""

    def __init__(self, request: SamplingFields, request_id: str, object_name: str, created: int, model: str):
        self.include_usage = request.stream_options is not None and request.stream_options.include_usage
        self.head = {"id": request_id, "object": object_name, "created": created, "model": model}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**self.head, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None


class DeltaTracker:
    """Turns one request's cumulative outputs into what each choice gained since the last chunk."""

    def __init__(self) -> None:
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def deltas(self, output: RequestOutput) -> list[Delta]:
        deltas = []
        for completion in output.outputs:
            index = completion.index
            if index in self.done:
                continue
            chars, tokens = self.sent_chars.get(index, 0), self.sent_tokens.get(index, 0)
            text = completion.text[chars:]
            finish = completion.finish_reason
            if not text and finish is None:  # tokens still held back (a possible stop string, a partial character)
                continue
            logprobs = completion.logprobs[tokens:] if completion.logprobs is not None else None
            deltas.append(Delta(index, text, completion.token_ids[tokens:], logprobs, finish))
            self.sent_chars[index] = len(completion.text)
            self.sent_tokens[index] = len(completion.token_ids)
            if finish is not None:
                self.done.add(index)
        return deltas


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, metrics: ServerMetrics):
        self.llm = llm
        self.served_model_name = served_model_name
        self.metrics = metrics

    def check_request(self, request: SamplingFields) -> None:
        if request.model is not None and request.model != self.served_model_name:
            raise OpenAIError(404, f"The model {request.model!r} does not exist; this server serves "
                                   f"{self.served_model_name!r} (see GET /v1/models)", "model")
        if not request.use_beam_search:
            check_beam_fields_unused(request)

    def request_params(self, request: SamplingFields, max_tokens: int | None, logprobs: int | None,
                       best_of: int | None = None) -> SamplingParams | BeamSearchParams:
        """What the engine runs for this request: a beam search (use_beam_search) or sampling."""
        try:
            if request.use_beam_search:  # no max_tokens: as many as the context allows (the engine caps it)
                return beam_search_params(request, max_tokens or self.llm.max_model_len, logprobs, best_of)
            return self.sampling_params(request, max_tokens, logprobs, best_of)
        except ValueError as exc:
            raise invalid_request(exc, request) from exc

    def sampling_params(self, request: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        best_of: int | None = None) -> SamplingParams:
        try:
            logit_bias = {int(token): bias for token, bias in (request.logit_bias or {}).items()}
        except ValueError:
            raise OpenAIError(400, f"logit_bias={request.logit_bias!r}: keys must be token ids (integers as "
                                   "strings)", "logit_bias") from None
        return SamplingParams(
            n=request.n, best_of=best_of, temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p, top_k=request.top_k, min_p=request.min_p,
            seed=request.seed, max_tokens=max_tokens, stop=request.stop, stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos, logprobs=logprobs, skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, logit_bias=logit_bias or None,
            min_tokens=request.min_tokens, structured_outputs=structured_outputs(request),
            # a whole response reads the final output only: the engine builds none before it
            output_kind=RequestOutputKind.CUMULATIVE if request.stream else RequestOutputKind.FINAL_ONLY)

    async def start(self, request: SamplingFields, base_id: str, prompts: list[list[int]],
                    params: SamplingParams | BeamSearchParams, arrival_time: float) -> list[str]:
        """Add one engine request per prompt, all handed over at once (so their prompts share the first
        steps); if one is refused (the first in prompt order is reported), none runs."""
        request_ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        try:
            results = await asyncio.gather(*(self.llm.add_request(request_id, prompt, params, arrival_time)
                                             for request_id, prompt in zip(request_ids, prompts)),
                                           return_exceptions=True)
            refused = next((r for r in results if isinstance(r, BaseException)), None)
            if isinstance(refused, ValueError):
                raise invalid_request(refused, request) from refused
            if refused is not None:
                raise refused
        except BaseException:
            for request_id in request_ids:
                self.llm.abort(request_id)
            raise
        return request_ids

    async def merged_outputs(self, request_ids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of several requests as they come; leaving early aborts them all. One request (the
        usual case) is read directly: a consumer behind the engine then gets its latest output only."""
        if len(request_ids) == 1:
            outputs = self.llm.outputs(request_ids[0])
            try:
                async for item in outputs:
                    if item.finished:
                        self.metrics.record_finished(item)
                    yield 0, item
            finally:
                await outputs.aclose()  # aborts the request if it has not finished
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request_id: str) -> None:
            try:
                async for output in self.llm.outputs(request_id):
                    merged.put_nowait((index, output))
                merged.put_nowait((index, None))
            except Exception as exc:
                merged.put_nowait((index, exc))

        pumps = [asyncio.create_task(pump(i, request_id)) for i, request_id in enumerate(request_ids)]
        try:
            remaining = len(pumps)
            while remaining:
                index, item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    remaining -= 1
                    continue
                if item.finished:
                    self.metrics.record_finished(item)
                yield index, item
        finally:
            for task in pumps:  # a pump cancelled mid-request closes its outputs(), which aborts it
                task.cancel()

    async def final_outputs(self, request_ids: list[str]) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, output in self.merged_outputs(request_ids):
            if output.finished:
                finals[index] = output
        return [finals[i] for i in range(len(request_ids))]

    def stream_response(self, request_id: str, request_ids: list[str],
                        chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        """Server-sent events; the requests are aborted after it ends, even if it never started (a client gone)."""
        async def abort_all() -> None:  # async: Starlette runs it on the event loop, where AsyncLLM lives
            for engine_request_id in request_ids:
                self.llm.abort(engine_request_id)

        return StreamingResponse(self._sse(request_id, chunks), media_type="text/event-stream",
                                 background=BackgroundTask(abort_all))

    async def _sse(self, request_id: str, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """Server-sent events of the chunks; an error after the stream began is sent as an error event."""
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            self.metrics.requests.labels("success").inc()
        except asyncio.CancelledError:  # the client went away; closing `chunks` aborted the request
            self.metrics.requests.labels("aborted").inc()
            raise
        except Exception as exc:
            error = as_openai_error(exc, request_id)
            self.metrics.requests.labels("rejected" if error.status < 500 else "error").inc()
            yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"


def structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever one of response_format, structured_outputs or guided_* it
    uses (a "text" response_format is none)."""
    sources = _constraint_sources(request)
    if len(sources) > 1:
        raise InvalidInputError(f"the request constrains its output through {sorted(sources)}: use one of them",
                                sorted(sources)[1])
    if not sources:
        return None
    fields = next(iter(sources.values()))
    unknown = set(fields) - {"json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace"}
    if unknown:
        raise InvalidInputError(f"structured_outputs has unknown fields {sorted(unknown)}; it takes one of json, "
                                "json_object, regex, choice, grammar (and disable_any_whitespace)",
                                "structured_outputs")
    return StructuredOutputsParams(**fields)


def _constraint_sources(request: SamplingFields) -> dict[str, dict[str, Any]]:
    """Request field -> the StructuredOutputsParams fields it asks for, for each field that constrains the output."""
    sources = {}
    formats = request.response_format
    if formats is not None and formats.type == "json_object":
        sources["response_format"] = {"json_object": True}
    elif formats is not None and formats.type == "json_schema":
        if formats.json_schema is None or formats.json_schema.schema_ is None:
            raise InvalidInputError("response_format of type json_schema needs json_schema.schema, the JSON schema "
                                    "the answer must follow", "response_format")
        sources["response_format"] = {"json": formats.json_schema.schema_}
    if request.structured_outputs is not None:
        sources["structured_outputs"] = request.structured_outputs
    guided = {kind: getattr(request, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")
              if getattr(request, f"guided_{kind}") is not None}
    if guided:
        sources["guided_" + next(iter(guided))] = guided
    return sources
