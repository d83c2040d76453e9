"""Penalties, biases and bans on a whole batch of logits at once (tensors, no loop over the vocabulary).

- repetition_penalty (transformers): for every token in the prompt or the output, a positive logit
  is divided by the penalty and a negative one multiplied by it;
- presence / frequency penalties (OpenAI): logit -= presence * [count > 0] + frequency * count,
  counting generated tokens only;
- logit_bias added; tokens banned (-inf): eos and stop ids before min_tokens, bad words, and
  everything outside allowed_token_ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fasterllm.worker.input_buffers import host_to_device
from fasterllm.worker.request_states import RequestState


@dataclass
class LogitControls:
    repetition: torch.Tensor  # [S, 1]
    presence: torch.Tensor  # [S, 1]
    frequency: torch.Tensor  # [S, 1]
    output_counts: torch.Tensor  # [S, V] how often each token was generated
    seen: torch.Tensor  # [S, V] bool: in the prompt or the output
    bias: torch.Tensor  # [S, V]
    banned: torch.Tensor  # [S, V] bool

    @staticmethod
    def build(requests: list[RequestState], vocab_size: int, device: torch.device) -> "LogitControls | None":
        """One row per sampled row: the state of the request it samples for."""
        if not any(r.sampling_params.controls_logits for r in requests):
            return None
        rows = len(requests)

        def per_row(values: list[float]) -> torch.Tensor:
            return host_to_device(values, torch.float32, device)[:, None]

        def padded_index(lists: list[list[int]]) -> torch.Tensor:
            """[S, width] ids, short rows padded with vocab_size (an extra column absorbs them)."""
            width = max((len(ids) for ids in lists), default=0)
            return host_to_device([ids + [vocab_size] * (width - len(ids)) for ids in lists], torch.long,
                                  device).view(rows, width)

        def scatter(lists: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            """[S, V] with 1 added at every listed id of each row."""
            index = padded_index(lists)
            out = torch.zeros(rows, vocab_size + 1, dtype=dtype, device=device)
            return out.scatter_add_(1, index, torch.ones_like(index, dtype=dtype))[:, :vocab_size]

        params = [r.sampling_params for r in requests]
        bias_lists, bias_values, banned_lists = [], [], []
        for request, p in zip(requests, params):
            bias = p.logit_bias or {}
            bias_lists.append(list(bias))
            bias_values.append(list(bias.values()))
            banned_lists.append(_banned_ids(request))
        width = max(len(ids) for ids in bias_lists)
        values = host_to_device([v + [0.0] * (width - len(v)) for v in bias_values], torch.float32,
                                device).view(rows, width)
        bias = torch.zeros(rows, vocab_size + 1, device=device).scatter_(1, padded_index(bias_lists), values)
        banned = scatter(banned_lists, torch.int32) > 0
        allowed = [p.allowed_token_ids for p in params]
        if any(a is not None for a in allowed):
            permitted = scatter([a or [] for a in allowed], torch.int32) > 0
            unrestricted = host_to_device([a is None for a in allowed], torch.bool, device)[:, None]
            banned |= ~(permitted | unrestricted)
        return LogitControls(
            repetition=per_row([p.repetition_penalty for p in params]),
            presence=per_row([p.presence_penalty for p in params]),
            frequency=per_row([p.frequency_penalty for p in params]),
            output_counts=scatter([r.output_token_ids for r in requests], torch.float32),
            seen=scatter([r.token_ids for r in requests], torch.int32) > 0,
            bias=bias[:, :vocab_size], banned=banned)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, penalized, logits)
        logits = logits - self.presence * (self.output_counts > 0) - self.frequency * self.output_counts
        return (logits + self.bias).masked_fill(self.banned, float("-inf"))


def _banned_ids(request: RequestState) -> list[int]:
    output = request.output_token_ids
    banned = list(request.early_banned_ids) if len(output) < request.sampling_params.min_tokens else []
    for word in request.bad_word_ids:
        prefix = word[:-1]
        # a one-token word is always banned; a longer one only as the token that would complete it
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
            banned.append(word[-1])
    return banned
