"""Token ids -> text, incrementally; stop strings; logprobs; RequestOutputs.

Decoding a growing token list one token at a time must not split a multi-byte character, and
must keep the spaces that tokenizers drop at the start of a decode. Each step decodes a short
window (a few earlier tokens for context + the new ones) and keeps only the new text, waiting while
the window ends in an incomplete character (U+FFFD). A byte-level BPE's text is its tokens' bytes
joined (TokenizerWrapper.token_bytes): there the new tokens' bytes are decoded here, the same text
without a call into the tokenizer per token.
"""
from __future__ import annotations

from fasterllm.engine.parallel_sampling import best_samples
from fasterllm.engine.request import Request
from fasterllm.loader.tokenizer import TokenizerWrapper
from fasterllm.outputs import CompletionOutput, Logprob, RequestOutput
from fasterllm.sampling_params import BeamSearchParams, SamplingParams
from fasterllm.worker.step_messages import ModelRunnerOutput

_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TokenizerWrapper, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop_strings: list[str], include_stop_str_in_output: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = stop_strings
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in stop_strings), default=1) - 1
        # the tail of the prompt gives the first output tokens their left context
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        # the bytes of the tokens past read_offset, where the tokenizer's text is its tokens' bytes and the prompt's
        # tail ends on a whole character; None: each window decoded by the tokenizer
        self.pending: bytes | None = b"" if tokenizer.decodes_bytes and not tokenizer.decode(
            self.tokens, skip_special_tokens).endswith(_INCOMPLETE) else None

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that now ends the text, if any (the text is cut there)."""
        searched_from = len(self.text)
        tokens, tokenizer, skip = self.tokens, self.tokenizer, self.skip_special_tokens
        for token_id in token_ids:  # per generated token of every running request: kept lean
            tokens.append(token_id)
            if self.pending is not None:
                piece = tokenizer.token_bytes(token_id, skip)
                if piece is not None:
                    pending = self.pending = self.pending + piece
                    new = pending.decode("utf-8", "replace")
                    if new and not new.endswith(_INCOMPLETE):
                        self.text += new
                        self.pending = b""
                        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
                    continue
                self.pending = None  # the tokenizer decodes from here on: the offsets are where it expects them
            prefix, read = self.prefix_offset, self.read_offset
            # the window's text before the new tokens (one token, once a step's text came out whole), then with them
            before = tokenizer.decode_one(tokens[prefix], skip) if read - prefix == 1 else \
                tokenizer.decode(tokens[prefix:read], skip)
            after = tokenizer.decode(tokens[prefix:], skip)
            if len(after) > len(before) and not after.endswith(_INCOMPLETE):
                self.text += after[len(before):]
                self.prefix_offset, self.read_offset = read, len(tokens)
        if not self.stop_strings:
            return None
        return self._find_stop(max(0, searched_from - self.hold_back))

    def _find_stop(self, search_start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            index = self.text.find(stop, search_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[:index + len(stop) if self.include_stop else index]
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, a tail that might start a stop string is held back."""
        if finished or not self.hold_back:
            return self.text
        return self.text[:max(0, len(self.text) - self.hold_back)]


def text_decodable_elsewhere(params: SamplingParams | BeamSearchParams) -> bool:
    """Whether a request's text may be decoded outside the engine, from the token ids of its outputs: one sequence
    (the best of several are chosen inside), no stop strings (the engine must see the text to stop there), not a
    beam search (its hypotheses are decoded when it ends)."""
    return isinstance(params, SamplingParams) and params.best_of == 1 and not params.stop_strings


def detokenizer_for(tokenizer: TokenizerWrapper, prompt_token_ids: list[int],
                    params: SamplingParams) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop_strings,
                                  params.include_stop_str_in_output)


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerWrapper, text_elsewhere: bool = False):
        """text_elsewhere: the engine runs in a process of its own and the server's process decodes the text of
        the requests text_decodable_elsewhere allows (their outputs here carry token ids and empty text)."""
        self.tokenizer = tokenizer
        self.text_elsewhere = text_elsewhere
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if not (self.text_elsewhere and text_decodable_elsewhere(params)):
            self.detokenizers[request.request_id] = detokenizer_for(self.tokenizer, request.prompt_token_ids, params)

    def new_tokens(self, request: Request, token_ids: list[int]) -> str | None:
        """Detokenize a request's new tokens; returns a stop string if one was found."""
        detokenizer = self.detokenizers.get(request.request_id)
        return None if detokenizer is None else detokenizer.add_tokens(token_ids)

    def make_output(self, head: Request) -> RequestOutput:
        """The output of a request and its parallel samples (head.family), under the head's id."""
        params = head.sampling_params
        tracked = params.logprobs is not None or params.ranks_samples
        finished = head.family_finished
        # positional: a streamed step builds one per running request
        completions = [CompletionOutput(index, self._text(member), list(member.output_token_ids),
                                        member.cumulative_logprob if tracked else None, member.logprobs,
                                        member.finish_reason, member.stop_reason)
                       for index, member in enumerate(head.family)]
        if finished:
            for member in head.family:
                self.detokenizers.pop(member.request_id, None)
            completions = best_samples(completions, params)
        return RequestOutput(head.request_id, head.prompt, head.prompt_token_ids, completions,
                             finished, head.metrics, head.prompt_logprobs, head.encoder_prompt, head.encoder_token_ids)

    def _text(self, request: Request) -> str:
        detokenizer = self.detokenizers.get(request.request_id)
        return "" if detokenizer is None else detokenizer.visible_text(request.finished)

    def record_logprobs(self, rows: list[Request | None], result: ModelRunnerOutput) -> None:
        """Each sampled row's logprobs into its request (rows: the request of each row; None skipped)."""
        if result.logprobs is None:
            return
        ids, values, ranks = result.logprob_token_ids, result.logprobs, result.sampled_ranks
        for row, request in enumerate(rows):
            if request is None:
                continue
            params = request.sampling_params
            if params.logprobs is None and not params.ranks_samples:
                continue
            request.cumulative_logprob += values[row][0]
            if params.logprobs is not None:
                request.logprobs.append(self.decode_logprobs(ids[row], values[row], ranks[row], params.logprobs))

    def record_prompt_logprobs(self, requests: dict[str, Request], scored: dict) -> None:
        """The scored prompt positions of the step into their requests; a recompute scores positions again, and
        only the first scoring is kept."""
        for request_id, (start, ids, values, ranks) in scored.items():
            request = requests[request_id]
            wanted = request.sampling_params.prompt_logprobs
            for offset, (row_ids, row_values, rank) in enumerate(zip(ids, values, ranks)):
                if len(request.prompt_logprobs) == start + offset + 1:
                    request.prompt_logprobs.append(self.decode_logprobs(row_ids, row_values, rank, wanted))

    def remove(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)

    def decode_logprobs(self, ids: list[int], values: list[float], rank_of_sampled: int,
                        num_wanted: int) -> dict[int, Logprob]:
        """One position's logprobs: the sampled token (first) and the top num_wanted alternatives."""
        def text(token_id: int) -> str:
            return self.tokenizer.decode_one(token_id, skip_special_tokens=False)

        entry = {ids[0]: Logprob(values[0], rank_of_sampled, text(ids[0]))}
        for rank, (token_id, value) in enumerate(zip(ids[1:1 + num_wanted], values[1:1 + num_wanted]), start=1):
            entry.setdefault(token_id, Logprob(value, rank, text(token_id)))
        return entry
