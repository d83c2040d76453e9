"""Structured output: each constrained request's grammar matcher (llguidance), the token bitmask of its rows for
the step, and the matcher advanced by every accepted token. Engine-side, like the request: the matcher survives
preemption, a parallel sample forks its parent's, and the worker only applies the bitmask it is sent.

llguidance was measured against xgrammar on our tokenizer (benchmarks/RESULTS.md): xgrammar fills a mask in ~6 us
against ~14 us, but llguidance needs no other package (xgrammar requires torch, transformers and triton), builds
its tokenizer from the `tokenizers` JSON we already hold, and compiles lazily (~2 ms for a nested schema).
"""
from __future__ import annotations

import json
import weakref
from collections import OrderedDict

import numpy as np

from fasterllm.engine.request import Request
from fasterllm.engine.scheduler import ScheduledBatch
from fasterllm.errors import InvalidInputError
from fasterllm.loader.tokenizer import TokenizerWrapper
from fasterllm.sampling_params import StructuredOutputsParams

_GRAMMAR_CACHE_SIZE = 256


class StructuredOutputs:
    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._ll_tokenizer = None  # built on the first constrained request (~0.3 s)
        self._executor = None  # llguidance's thread pool: the rows' masks are filled in parallel
        self._grammars: OrderedDict[str, str] = OrderedDict()  # constraint -> llguidance grammar, most recent last
        # constrained requests still referenced (a fork's family keeps its parent): none, and a step costs nothing
        self._live: weakref.WeakSet[Request] = weakref.WeakSet()

    def start(self, request: Request) -> None:
        """Give a constrained request its matcher; a constraint the engine cannot compile is an InvalidInputError
        naming the field."""
        import llguidance

        params = request.sampling_params.structured_outputs
        field = f"structured_outputs.{params.kind}"
        try:  # a JSON schema that is not JSON fails here, a grammar llguidance rejects in the matcher
            matcher = llguidance.LLMatcher(self._tokenizer(), self._grammar(params), log_level=0)
        except ValueError as exc:
            raise InvalidInputError(f"{field} could not be compiled: {exc}", field) from exc
        if matcher.is_error():
            raise InvalidInputError(f"{field} could not be compiled: {matcher.get_error()}", field)
        request.matcher = matcher
        self._live.add(request)

    def attach_masks(self, batch: ScheduledBatch) -> None:
        """Tell the worker which tokens each sampled row of a constrained request may take: the message's
        grammar_rows and a [rows, ceil(vocab / 32)] int32 bitmask (bit t set where token t may come next)."""
        if not self._live:
            return
        import llguidance.numpy

        message, row, constrained = batch.message, 0, []
        for item, num_samples in zip(batch.scheduled, message.num_samples):
            if num_samples and item.request.matcher is not None:
                message.grammar_rows.extend(range(row, row + num_samples))
                constrained.extend([item.request] * num_samples)
            row += num_samples
        if not constrained:
            return
        mask: np.ndarray = llguidance.numpy.allocate_token_bitmask(len(constrained), self.vocab_size)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        first_row: dict[int, int] = {}  # a best_of parent's rows share one matcher: filled once, then copied
        for index, request in enumerate(constrained):
            first_row.setdefault(id(request), index)
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(constrained[index].matcher, index) for index in first_row.values()], mask)
        for index, request in enumerate(constrained):
            mask[index] = mask[first_row[id(request)]]
        message.grammar_bitmask = mask

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance

            self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                        eos_token=self.eos_token_ids[0])
        return self._ll_tokenizer

    def _grammar(self, params: StructuredOutputsParams) -> str:
        import llguidance

        key = json.dumps([params.json, params.json_object, params.regex, params.choice, params.grammar,
                          params.disable_any_whitespace], sort_keys=True)
        if key not in self._grammars:  # the grammar's text; llguidance checks it when a matcher is made
            if params.kind in ("json", "json_object"):
                schema = params.json if params.kind == "json" else {"type": "object"}
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema),
                    defaults={"whitespace_flexible": not params.disable_any_whitespace})
            elif params.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(params.regex)
            elif params.kind == "choice":
                grammar = llguidance.LLMatcher.grammar_from_regex("|".join(_regex_literal(c) for c in params.choice))
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(params.grammar)
            self._grammars[key] = grammar
            if len(self._grammars) > _GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return self._grammars[key]


def _regex_literal(text: str) -> str:
    """text as a regular expression matching exactly it (llguidance's regex syntax: Rust's, whose meta characters
    these are)."""
    return "".join("\\" + ch if ch in "\\.+*?()|[]{}^$#&-~" else ch for ch in text)
