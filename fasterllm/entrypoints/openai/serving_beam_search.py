"""use_beam_search on /v1/completions and /v1/chat/completions: the request's fields -> BeamSearchParams.

As vLLM's server: `n` is the beam width and the number of choices returned (completions: `best_of`,
when given, is the width and `n` the choices kept), best first; `length_penalty` and `early_stopping`
are extra fields. Beam search keeps the most likely continuations, so a field that samples, filters,
penalises or stops on text has no meaning with it and is refused (400 naming the field) rather than
ignored. A streamed search sends its choices whole, in one chunk, when the search ends: a beam's text
is not final until then.
"""
from __future__ import annotations

from fasterllm.entrypoints.openai.protocol import OpenAIError, SamplingFields
from fasterllm.sampling_params import MAX_BEAM_WIDTH, BeamSearchParams

# field -> the values that leave it off; with use_beam_search any other value is refused
_OFF_VALUES: dict[str, tuple] = {
    "temperature": (None, 0.0), "top_p": (None, 1.0), "top_k": (0, -1), "min_p": (0.0,), "seed": (None,),
    "stop": (None, "", []), "stop_token_ids": (None, []), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,), "logit_bias": (None, {}), "min_tokens": (0,), "include_stop_str_in_output": (False,),
}


def check_beam_fields_unused(request: SamplingFields) -> None:
    """length_penalty and early_stopping only mean something to a beam search."""
    for field in ("length_penalty", "early_stopping"):
        if getattr(request, field) is not None:
            raise OpenAIError(400, f"{field}={getattr(request, field)!r} only applies to beam search; add "
                                   f"use_beam_search=true (with n = the beam width) or leave {field} out", field)


def beam_search_params(request: SamplingFields, max_tokens: int, logprobs: int | None,
                       best_of: int | None = None) -> BeamSearchParams:
    """The search a request asks for; a field that makes no sense with beams is a 400 naming it."""
    for field, off_values in _OFF_VALUES.items():
        value = getattr(request, field)
        if value not in off_values:
            raise OpenAIError(400, f"{field}={value!r} cannot be used with use_beam_search=true: beam search keeps "
                                   f"the most likely continuations, it does not sample, filter, penalise or stop on "
                                   f"text; leave {field} out (or set use_beam_search=false)", field)
    if logprobs is not None:
        raise OpenAIError(400, "logprobs cannot be used with use_beam_search=true (each choice reports no per-token "
                               "logprobs); leave logprobs out", "logprobs")
    width, width_field = (request.n, "n") if best_of is None else (best_of, "best_of")
    if width > MAX_BEAM_WIDTH:
        raise OpenAIError(400, f"{width_field}={width} is too large for beam search: the beam width is at most "
                               f"{MAX_BEAM_WIDTH}; lower {width_field}", width_field)
    if request.n > width:
        raise OpenAIError(400, f"n={request.n} must be <= best_of={width} (the beam width)", "n")
    return BeamSearchParams(beam_width=width, n=request.n, max_tokens=max_tokens,
                            length_penalty=1.0 if request.length_penalty is None else request.length_penalty,
                            early_stopping=False if request.early_stopping is None else request.early_stopping,
                            ignore_eos=request.ignore_eos, skip_special_tokens=request.skip_special_tokens)
