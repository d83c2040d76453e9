"""What generate() returns: one RequestOutput per prompt, each with its completions."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# one dict per generated token: token id -> Logprob, holding the top-n and the sampled token
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_tokens: int) -> float | None:
        """Seconds between output tokens after the first, for num_tokens generated (None: fewer than 2, or no
        timestamps)."""
        if num_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (num_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    # with SamplingParams.prompt_logprobs: None for the first token, then one dict per prompt token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # encoder-decoder models: the encoder's input (prompt and prompt_token_ids are then the decoder's)
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None


@dataclass
class BeamSearchOutput:
    """What LLM.beam_search returns for one prompt: its hypotheses, best first (as vLLM's)."""
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[CompletionOutput]


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # pooled (and, if the model asks, L2-normalised) vector

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns for one input (as vLLM's): `.outputs.embedding` is the vector."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
