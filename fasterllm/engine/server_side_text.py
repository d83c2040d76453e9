"""The outputs of an engine that runs in a process of its own, as the server's process hands them on: rebuilt from
the engine's deltas (output_deltas.py), with the text of the requests output_processor.text_decodable_elsewhere
allows decoded here (vLLM's front-end does the same). For those the engine sends token ids and empty text, and this
side runs the same incremental detokenizer over the token ids, so the text is the one the engine would have made and
the engine's process, which also drives the GPU, spends no time on it."""
from __future__ import annotations

from fasterllm.engine.output_deltas import OutputDecoder
from fasterllm.engine.output_processor import IncrementalDetokenizer, detokenizer_for, text_decodable_elsewhere
from fasterllm.engine.stop_checker import ended_by_eos
from fasterllm.loader.tokenizer import TokenizerWrapper
from fasterllm.outputs import RequestOutput
from fasterllm.sampling_params import BeamSearchParams, SamplingParams


class ServerSideText:
    def __init__(self, tokenizer: TokenizerWrapper, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._deltas = OutputDecoder()  # every request's outputs so far, as the engine sent them (no text of ours)
        # the requests added and not ended: an output of any other id is stale (its request was aborted while the turn
        # was on its way) and is dropped, not kept by the decoder for good
        self._live: set[str] = set()
        self._params: dict[str, SamplingParams] = {}  # the requests this side decodes
        # request id -> its detokenizer and how many of its tokens were its prompt's (the rest: output tokens fed)
        self._decoding: dict[str, tuple[IncrementalDetokenizer, int]] = {}

    def expect(self, request_id: str, params: SamplingParams | BeamSearchParams) -> None:
        """A request is being added: note it, and whether its text is decoded here."""
        self._live.add(request_id)
        if text_decodable_elsewhere(params):
            self._params[request_id] = params

    def forget(self, request_id: str) -> None:
        """The request ended, or was aborted or refused: a later request under its id starts afresh."""
        self._live.discard(request_id)
        self._deltas.forget(request_id)
        self._params.pop(request_id, None)
        self._decoding.pop(request_id, None)

    def outputs(self, encoded: list[tuple]) -> list[tuple[str, RequestOutput | Exception]]:
        """The outputs of one turn of the engine process (OutputEncoder's form), those decoded here with their text."""
        outputs = []
        for request_id, output in self._deltas.decode(encoded, self._live):
            params = self._params.get(request_id)
            if params is not None and not isinstance(output, Exception):
                output = self._with_text(request_id, output, params)
            if isinstance(output, Exception) or output.finished:
                self.forget(request_id)
            outputs.append((request_id, output))
        return outputs

    def _with_text(self, request_id: str, output: RequestOutput, params: SamplingParams) -> RequestOutput:
        """The output with its text decoded. The decoder builds a new output each turn (whole from the pickle, or
        extended from its last), so writing the text into it changes no earlier output; the engine's text of this
        request is empty, so what the decoder extends next turn is replaced again."""
        if request_id not in self._decoding:
            detokenizer = detokenizer_for(self.tokenizer, output.prompt_token_ids, params)
            self._decoding[request_id] = (detokenizer, len(detokenizer.tokens))
        detokenizer, context = self._decoding[request_id]
        completion = output.outputs[0]
        token_ids = completion.token_ids
        end = len(token_ids) - ended_by_eos(token_ids, output.finished, params, self.eos_token_ids)
        detokenizer.add_tokens(token_ids[len(detokenizer.tokens) - context:end])
        completion.text = detokenizer.visible_text(output.finished)
        return output
