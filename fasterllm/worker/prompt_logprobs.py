"""Prompt logprobs: for each scored prompt position, the logprob and rank of the prompt's actual next token and
the top-n alternatives, for the requests that asked (prompt_logprobs)."""
from __future__ import annotations

import torch

from fasterllm.worker.request_states import RequestState


def score_prompt_positions(logits: torch.Tensor, prompt_rows: list[tuple[str, RequestState, int, int, int]]) -> dict:
    """logits: the scored positions' rows, request after request (prompt_rows: id, state, first position, first
    token row, count). Returns request id -> (first position, ids, logprobs, ranks) per position."""
    if not prompt_rows:
        return {}
    targets = torch.tensor([t for _, state, start, _, count in prompt_rows
                            for t in state.prompt_token_ids[start + 1:start + 1 + count]], device=logits.device)
    logprobs = logits.log_softmax(dim=-1)
    actual = logprobs.gather(-1, targets[:, None])
    ranks = ((logprobs > actual).sum(dim=-1) + 1).tolist()
    top = logprobs.topk(max(state.sampling_params.prompt_logprobs for _, state, *_ in prompt_rows), dim=-1)
    ids = torch.cat([targets[:, None], top.indices], dim=1).tolist()
    values = torch.cat([actual, top.values], dim=1).tolist()
    result, row = {}, 0
    for request_id, _, start, _, count in prompt_rows:
        result[request_id] = (start, ids[row:row + count], values[row:row + count], ranks[row:row + count])
        row += count
    return result
