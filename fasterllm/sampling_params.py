"""SamplingParams: how one request picks its tokens and when it stops. Bad values raise InvalidInputError (a
ValueError that names the field)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from fasterllm.errors import InvalidInputError

MAX_LOGPROBS = 20
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class StructuredOutputsParams:
    """A constraint the output must satisfy, shaped like vLLM's: exactly one of a JSON schema (a dict or its JSON
    text), any JSON object, a regular expression, one of a list of strings, or a Lark grammar (llguidance's
    dialect). The grammar is compiled when the request is added; a bad one is an error naming the field."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # JSON only: no whitespace between tokens (compact separators), so an answer of bounded content has a bounded
    # length; by default JSON may carry any whitespace, as vLLM allows
    disable_any_whitespace: bool = False

    @property
    def kind(self) -> str:
        """The one field set: json, json_object, regex, choice or grammar."""
        return self._given()[0]

    def _given(self) -> list[str]:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return given + (["json_object"] if self.json_object else [])

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise InvalidInputError(f"structured_outputs sets {given or 'nothing'}: set exactly one of json, "
                                    "json_object, regex, choice, grammar", "structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidInputError(f"structured_outputs.json={self.json!r} must be a JSON schema (a dict or its "
                                    "JSON text)", "structured_outputs.json")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidInputError(f"structured_outputs.{name}={value!r} must be a non-empty string",
                                        f"structured_outputs.{name}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice or any(
                not isinstance(c, str) or not c for c in self.choice)):
            raise InvalidInputError(f"structured_outputs.choice={self.choice!r} must be a non-empty list of "
                                    "non-empty strings", "structured_outputs.choice")


class RequestOutputKind(enum.Enum):
    """Which outputs a request yields (vLLM's names and values)."""
    CUMULATIVE = 0  # one every step the request makes progress, with everything so far (a stream)
    FINAL_ONLY = 2  # one, when the request finishes: no output is built in between (LLM.generate, a whole response)


@dataclass
class SamplingParams:
    """Per-request decoding settings, named as in vLLM and the OpenAI API.

    temperature 0 means greedy. top_k 0 or -1, top_p 1 and min_p 0 switch those filters off.
    Filters apply in transformers' order: temperature, top-k, top-p, min-p.
    """

    n: int = 1
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-n alternatives at every prompt position (no prefix-cache reuse)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # logit controls, applied to the raw logits before temperature and the filters
    repetition_penalty: float = 1.0  # transformers' definition: prompt and generated tokens
    presence_penalty: float = 0.0  # OpenAI's definitions: generated tokens only
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0  # eos and stop_token_ids are banned until this many tokens exist
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # the output must match a schema, regex, ...
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidInputError(f"n={self.n!r} must be an integer >= 1", "n")
        if self.best_of is None:
            self.best_of = self.n
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise InvalidInputError(f"best_of={self.best_of!r} must be an integer >= n={self.n}", "best_of")
        _check_number("temperature", self.temperature, 0.0, math.inf, "must be >= 0 (0 means greedy)")
        _check_number("top_p", self.top_p, 0.0, 1.0, "must be in (0, 1]")
        if self.top_p <= 0.0:
            raise InvalidInputError(f"top_p={self.top_p} must be in (0, 1]; use top_p=1 to disable it", "top_p")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidInputError(f"top_k={self.top_k!r} must be an integer >= 1, or 0 / -1 to disable it", "top_k")
        _check_number("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidInputError(f"seed={self.seed!r} must be an integer or None", "seed")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidInputError(f"max_tokens={self.max_tokens!r} must be an integer >= 1 (or None for "
                             "as many as the context allows)", "max_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or
                                          not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidInputError(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or
                                                 not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidInputError(
                f"prompt_logprobs={self.prompt_logprobs!r} must be an integer in [0, {MAX_LOGPROBS}]",
                "prompt_logprobs")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidInputError(f"stop={self.stop!r}: every stop string must be a non-empty string", "stop")
        self.stop_strings = stops
        for t in self.stop_token_ids or []:
            if not isinstance(t, int) or t < 0:
                raise InvalidInputError(
                    f"stop_token_ids={self.stop_token_ids!r} must be non-negative token ids", "stop_token_ids")
        _check_number("repetition_penalty", self.repetition_penalty, 1e-6, math.inf, "must be > 0 (1 = off)")
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0, "must be in [-2, 2]")
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "must be in [-2, 2]")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise InvalidInputError(f"logit_bias key {token!r} must be a non-negative token id", "logit_bias")
            _check_number(f"logit_bias[{token}]", bias, -100.0, 100.0, "must be in [-100, 100]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidInputError(
                f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens={self.max_tokens}]", "min_tokens")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words or []):
            raise InvalidInputError(f"bad_words={self.bad_words!r} must be non-empty strings", "bad_words")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise InvalidInputError(
                f"allowed_token_ids={self.allowed_token_ids!r} must be a non-empty list of token ids",
                "allowed_token_ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidInputError(f"structured_outputs={self.structured_outputs!r} must be a "
                                    "StructuredOutputsParams", "structured_outputs")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidInputError(f"output_kind={self.output_kind!r} must be a RequestOutputKind (CUMULATIVE or "
                                    "FINAL_ONLY)", "output_kind")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def ranks_samples(self) -> bool:
        """best_of > n: every sample's cumulative logprob is needed to choose the n returned."""
        return self.best_of > self.n

    @property
    def controls_logits(self) -> bool:
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.min_tokens or self.bad_words or self.allowed_token_ids)


def _check_number(name: str, value: object, low: float, high: float, rule: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidInputError(f"{name}={value!r} must be a finite number; it {rule}", name.split("[")[0])
    if not low <= value <= high:
        raise InvalidInputError(f"{name}={value} is out of range: it {rule}", name.split("[")[0])


MAX_BEAM_WIDTH = 64


@dataclass
class BeamSearchParams:
    """Beam search settings, named as in vLLM (beam_width, max_tokens, length_penalty, ignore_eos) and
    transformers (early_stopping).

    Each step keeps the beam_width best continuations over all beams x vocabulary by cumulative
    logprob; a finished hypothesis scores cumulative_logprob / generated_length ** length_penalty.
    early_stopping: True stops once beam_width hypotheses are finished; False stops when no running
    beam can still beat the worst of them (judged at the current length); "never" judges it at the
    longest possible length when length_penalty > 0 (the canonical, slower search).
    n: how many hypotheses are returned, best first (default beam_width).
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    n: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or \
                not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidInputError(
                f"beam_width={self.beam_width!r} must be an integer in [1, {MAX_BEAM_WIDTH}]", "beam_width")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidInputError(f"max_tokens={self.max_tokens!r} must be an integer >= 1", "max_tokens")
        _check_number("length_penalty", self.length_penalty, -math.inf, math.inf, "is any finite number")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidInputError(
                f"early_stopping={self.early_stopping!r} must be True, False or 'never'", "early_stopping")
        if self.n is None:
            self.n = self.beam_width
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= self.beam_width:
            raise InvalidInputError(f"n={self.n!r} must be an integer in [1, beam_width={self.beam_width}]", "n")

    def as_sampling_params(self) -> SamplingParams:
        """How each beam runs in the engine: greedy rows whose top logprobs the beam search reads.

        eos never ends a beam by itself (the search turns eos continuations into hypotheses)."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True,
                              skip_special_tokens=self.skip_special_tokens)
