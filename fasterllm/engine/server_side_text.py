"""The text of requests whose engine runs in a process of its own, decoded in the server's process (vLLM's front-end
does the same): for the requests output_processor.text_decodable_elsewhere allows, the engine sends token ids and
empty text, and this side runs the same incremental detokenizer over the token ids, so the text is the one the engine
would have made and the engine's process, which also drives the GPU, spends no time on it."""
from __future__ import annotations

from fasterllm.engine.output_processor import IncrementalDetokenizer, detokenizer_for, text_decodable_elsewhere
from fasterllm.loader.tokenizer import TokenizerWrapper
from fasterllm.outputs import RequestOutput
from fasterllm.sampling_params import BeamSearchParams, SamplingParams


class ServerSideText:
    def __init__(self, tokenizer: TokenizerWrapper, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._params: dict[str, SamplingParams] = {}  # the requests this side decodes
        # request id -> its detokenizer and how many of its tokens were its prompt's (the rest: output tokens fed)
        self._decoding: dict[str, tuple[IncrementalDetokenizer, int]] = {}

    def expect(self, request_id: str, params: SamplingParams | BeamSearchParams) -> None:
        """A request is being added: note it if its text is decoded here."""
        if text_decodable_elsewhere(params):
            self._params[request_id] = params

    def forget(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._decoding.pop(request_id, None)

    def fill(self, outputs: list[tuple[str, RequestOutput | Exception]]) -> None:
        """Set the text of the outputs this side decodes (each a new object, not yet handed to anyone)."""
        for request_id, output in outputs:
            params = self._params.get(request_id)
            if params is None:
                continue
            if isinstance(output, Exception):
                self.forget(request_id)
                continue
            if request_id not in self._decoding:
                detokenizer = detokenizer_for(self.tokenizer, output.prompt_token_ids, params)
                self._decoding[request_id] = (detokenizer, len(detokenizer.tokens))
            detokenizer, context = self._decoding[request_id]
            completion = output.outputs[0]
            token_ids = completion.token_ids
            end = len(token_ids)
            # as stop_checker does: an eos that ends the sequence is not decoded
            if (output.finished and completion.finish_reason == "stop" and completion.stop_reason is None
                    and not params.ignore_eos and end and token_ids[-1] in self.eos_token_ids):
                end -= 1
            detokenizer.add_tokens(token_ids[len(detokenizer.tokens) - context:end])
            completion.text = detokenizer.visible_text(output.finished)
            if output.finished:
                self.forget(request_id)
