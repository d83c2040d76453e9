"""Logits -> token ids for a whole batch at once: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Random rows are drawn with the exponential race (argmax of p / E, E ~ Exp(1)), which samples from p
without normalising it. A seeded request draws its E from its own generator, so its tokens do not
depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fasterllm.kernels.native import cpu_argmax
from fasterllm.sampling_params import SamplingParams
from fasterllm.worker.input_buffers import host_to_device
from fasterllm.worker.logit_controls import LogitControls


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [S], 1.0 on greedy rows; None (like the rest) when every row is greedy
    top_k: torch.Tensor | None  # [S] long, vocab size where off; None when no row uses it
    top_p: torch.Tensor | None  # [S], 1.0 where off
    min_p: torch.Tensor | None  # [S], 0.0 where off
    greedy: torch.Tensor | None  # [S] bool
    all_greedy: bool
    generators: list[torch.Generator | None]
    max_num_logprobs: int | None
    controls: LogitControls | None = None  # penalties, biases, bans; None when no row uses any
    allowed: torch.Tensor | None = None  # [S, V] bool: structured output's grammar masks; None when no row has one

    @staticmethod
    def build(params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device, controls: LogitControls | None = None) -> "SamplingMetadata":
        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return host_to_device(values, dtype, device)

        greedy = [p.greedy for p in params]
        # best_of > n ranks samples by cumulative logprob, so those rows need logprobs too
        wanted = [p.logprobs or 0 for p in params if p.logprobs is not None or p.ranks_samples]
        if all(greedy):  # argmax alone: no per-row settings to send to the device
            return SamplingMetadata(None, None, None, None, None, True, generators,
                                    max(wanted) if wanted else None, controls)
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        return SamplingMetadata(
            temperature=column([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            top_k=column(top_k, torch.long) if any(k < vocab_size for k in top_k) else None,
            top_p=column([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in params) else None,
            min_p=column([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None,
            greedy=column(greedy, torch.bool),
            all_greedy=all(greedy),
            generators=generators,
            max_num_logprobs=max(wanted) if wanted else None,
            controls=controls,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    # when any row asked for logprobs: [S, 1 + k] ids (sampled first) and their logprobs and ranks
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    _host: dict[str, torch.Tensor] = field(default_factory=dict)  # pinned copies, valid once _ready has passed
    _ready: torch.cuda.Event | None = None

    def copy_to_host_async(self) -> None:
        """On a GPU: queue the copies to pinned host memory now, right behind this step's sampling, so
        that reading them later waits for this step only, not for a lookahead step queued after it."""
        for name in ("token_ids", "logprob_token_ids", "logprobs", "sampled_ranks"):
            tensor = getattr(self, name)
            if tensor is not None:
                self._host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                self._host[name].copy_(tensor, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def host(self, name: str) -> torch.Tensor:
        """The tensor `name` on the host (waiting for its copy if one was queued)."""
        if self._ready is None:
            return getattr(self, name)
        self._ready.synchronize()
        return self._host[name]


def filtered_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, top-p, min-p, renormalised."""
    logits = logits / md.temperature[:, None]
    if md.top_k is not None or md.top_p is not None:
        logits = _top_k_top_p(logits, md.top_k, md.top_p)
    probs = logits.softmax(dim=-1)
    if md.min_p is not None:
        threshold = md.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop |= torch.arange(vocab, device=logits.device)[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # keep the smallest prefix whose mass reaches top_p; the first token is always kept
        drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: on a GPU one Triton kernel spread over the row (torch's takes one block per row), on the CPU
    one vectorized C++ pass (torch's compares one value at a time)."""
    if x.is_cuda:
        from fasterllm.kernels import argmax

        if argmax.fits(x):
            return argmax.argmax_rows(x)
    elif cpu_argmax.runs(x):
        return cpu_argmax.argmax_rows(x)
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, md: SamplingMetadata, argmax: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [S, V] fp32, one row per request that samples this step. argmax: each row's argmax of these logits,
    where it was computed already (a decode graph's); used only where no control or mask changes the logits."""
    raw_logits = logits
    if md.controls is not None:
        logits = md.controls.apply(logits)
    if md.allowed is not None:
        logits = logits.masked_fill(~md.allowed, float("-inf"))
    changed = md.controls is not None or md.allowed is not None
    greedy_tokens = row_argmax(logits) if argmax is None or changed else argmax
    if md.all_greedy:
        tokens = greedy_tokens
    else:
        probs = filtered_probs(logits, md)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in enumerate(md.generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        tokens = torch.where(md.greedy, greedy_tokens, row_argmax(probs / noise))
    if md.max_num_logprobs is None:
        return SamplerOutput(tokens)
    # logprobs of the model's own distribution, before any penalty or filter (as vLLM reports them)
    logprobs = raw_logits.log_softmax(dim=-1)
    top = logprobs.topk(md.max_num_logprobs, dim=-1) if md.max_num_logprobs else None
    sampled_logprob = logprobs.gather(-1, tokens[:, None])
    ranks = (logprobs > sampled_logprob).sum(dim=-1, dtype=torch.int32) + 1  # an int32 sum: ~5x faster than int64
    ids = tokens[:, None] if top is None else torch.cat([tokens[:, None], top.indices], dim=1)
    values = sampled_logprob if top is None else torch.cat([sampled_logprob, top.values], dim=1)
    return SamplerOutput(tokens, ids, values, ranks)
