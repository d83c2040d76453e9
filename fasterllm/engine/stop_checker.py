"""Whether a sequence stops after its new token, decided in one place: eos (unless ignore_eos), a stop token id,
the token limit, a grammar that is complete (structured output), or a stop string in the text (the detokenizer
finds it; an eos that ends the sequence is not detokenized). A token rule wins over a stop string the same token
completes. A beam search is not checked here: it decides when it ends (beam_search.py)."""
from __future__ import annotations

from collections.abc import Collection

from fasterllm.engine.output_processor import OutputProcessor
from fasterllm.engine.request import Request
from fasterllm.sampling_params import SamplingParams


def check_stop(request: Request, output_processor: OutputProcessor | None) -> tuple[str, int | str | None] | None:
    """The (finish_reason, stop_reason) that ends the request after its last token, or None. Detokenizes that
    token (output_processor None: token rules only, for the scheduler's unit tests)."""
    last = request.output_token_ids[-1]
    if last in request.eos_token_ids:
        return "stop", None
    if last in request.stop_token_ids:
        stop = "stop", last
    elif request.matcher is not None and request.matcher.is_stopped():  # nothing may follow but eos
        stop = "stop", None
    else:
        stop = ("length", None) if len(request.output_token_ids) >= request.max_tokens else None
    stop_string = output_processor.new_tokens(request, [last]) if output_processor is not None else None
    return stop or (("stop", stop_string) if stop_string is not None else None)


def ended_by_eos(token_ids: list[int], finished: bool, params: SamplingParams, eos_token_ids: Collection[int]) -> bool:
    """Whether a sequence's last token is the eos that ended it, read off its output (token ids, finished): check_stop
    tests eos before every other rule and stops there (unless ignore_eos) without detokenizing it, so a finished
    sequence ending in an eos ended by it, and text decoded outside the engine leaves it out too."""
    return finished and not params.ignore_eos and bool(token_ids) and token_ids[-1] in eos_token_ids
