"""Structured output: each constrained request's grammar matcher (llguidance), the token bitmask of its rows for
the step, and the matcher advanced by every accepted token. Engine-side, like the request: the matcher survives
preemption, a parallel sample forks its parent's, and the worker only applies the bitmask it is sent.

llguidance was measured against xgrammar on our tokenizer (benchmarks/RESULTS.md): xgrammar fills a mask in ~6 us
against ~14 us, but llguidance needs no other package (xgrammar requires torch, transformers and triton), builds
its tokenizer from the `tokenizers` JSON we already hold, and compiles lazily (~2 ms for a nested schema).

A constraint is checked when its request is added (a bad one is refused there, naming its field); its matcher is
built on a thread of its own, with llguidance's tokenizer the first time (~0.3 s; llguidance lets go of the
interpreter meanwhile), while the engine steps the other requests. The request waits in the queue until its matcher
is ready (Request.grammar_pending), without holding back those behind it.
"""
from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

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
        self._compiler: ThreadPoolExecutor | None = None  # builds matchers off the step loop
        self._compiling: list[Request] = []  # requests whose matcher is being built
        self._grammars: OrderedDict[str, str] = OrderedDict()  # constraint -> llguidance grammar, most recent last
        # constrained requests still referenced (a fork's family keeps its parent): none, and a step costs nothing
        self._live: weakref.WeakSet[Request] = weakref.WeakSet()

    def start(self, request: Request) -> None:
        """Check a constrained request's constraint (one the engine cannot compile is an InvalidInputError naming
        the field) and start building its matcher on the compiler thread."""
        import llguidance

        params = request.sampling_params.structured_outputs
        field = f"structured_outputs.{params.kind}"
        try:
            grammar = self._grammar(params)
        except ValueError as exc:
            raise InvalidInputError(f"{field} could not be compiled: {exc}", field) from exc
        error = llguidance.LLMatcher.validate_grammar(grammar)  # no tokenizer needed: a few milliseconds
        if error:
            raise InvalidInputError(f"{field} could not be compiled: {error}", field)
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="fasterllm-grammar")
        request.grammar_pending = self._compiler.submit(self._matcher, grammar)
        self._compiling.append(request)
        self._live.add(request)

    def _matcher(self, grammar: str):
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar could not be compiled: {matcher.get_error()}")
        return matcher

    def collect_compiled(self) -> list[tuple[Request, Exception]]:
        """Give each request whose matcher is built its matcher (it may be scheduled from now on); returns the
        requests whose matcher failed to build, with the error."""
        if not self._compiling:
            return []
        failed, still = [], []
        for request in self._compiling:
            future: Future = request.grammar_pending
            if request.finished:  # aborted while compiling
                continue
            if not future.done():
                still.append(request)
                continue
            request.grammar_pending = None
            if future.exception() is not None:
                failed.append((request, future.exception()))
            else:
                request.matcher = future.result()
        self._compiling = still
        return failed

    def wait_compiled(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) for a matcher being built: the engine has nothing else to run."""
        pending = [request.grammar_pending for request in self._compiling]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def samples_constrained(self, batch: ScheduledBatch) -> bool:
        """Whether a row the step samples belongs to a request with a grammar."""
        return bool(self._live) and any(num_samples and item.request.matcher is not None
                                        for item, num_samples in zip(batch.scheduled, batch.message.num_samples))

    def attach_masks(self, batch: ScheduledBatch) -> None:
        """Tell the worker which tokens each sampled row of a constrained request may take: the message's
        grammar_rows and a [rows, ceil(vocab / 32)] int32 bitmask (bit t set where token t may come next). A row of a
        request that has ended since the step was scheduled (its lookahead row, dropped) is left free."""
        if not self._live:
            return
        import llguidance.numpy

        message, row, constrained = batch.message, 0, []
        for item, num_samples in zip(batch.scheduled, message.num_samples):
            if num_samples and item.request.matcher is not None and not item.request.finished:
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
        """Built once, on the compiler thread (its only caller)."""
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
