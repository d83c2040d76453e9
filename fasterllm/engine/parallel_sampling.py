"""Parallel sampling (n, best_of): the request computes its prompt once and draws best_of first tokens from it;
its extra rows draw for the samples it then forks, one child per row sharing its blocks copy-on-write (a seeded
sample i draws from its own stream on the worker, so its tokens do not depend on the batch). With best_of > n,
the n samples of highest cumulative logprob are returned."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fasterllm.engine.request import Request
from fasterllm.outputs import CompletionOutput
from fasterllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fasterllm.engine.sequence_forks import SequenceForks


def name_samples(request: Request) -> None:
    """The ids of the samples the request will fork, the ids its extra rows draw for from the first token on."""
    request.sample_ids = [f"{request.request_id}#{index}" for index in range(1, request.sampling_params.best_of)]


def fork_sample(forks: SequenceForks, parent: Request, first_token: int, num_computed_tokens: int) -> Request:
    """The parent's next sample, forked after the prompt step with the first token its row drew."""
    child = forks.fork(parent, parent.sample_ids[len(parent.family) - 1], first_token, num_computed_tokens)
    child.family = parent.family
    parent.family.append(child)
    return child


def best_samples(completions: list[CompletionOutput], params: SamplingParams) -> list[CompletionOutput]:
    """The finished samples to return: all of them, or with best_of > n the n most likely, renumbered."""
    if not params.ranks_samples:
        return completions
    best = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[:params.n]
    for index, completion in enumerate(best):
        completion.index = index
    return best
