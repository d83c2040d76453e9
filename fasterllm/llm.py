"""LLM: the offline API, shaped like vLLM's (change the import, keep the code)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Union

from fasterllm.config import EngineArgs
from fasterllm.engine.embedding_engine import EmbeddingEngine
from fasterllm.engine.engine import Engine
from fasterllm.engine.frozen_heap import heap_frozen_while_generating
from fasterllm.engine.input_processor import as_prompt_list, prompt_value
from fasterllm.loader.tokenizer import TokenizerWrapper
from fasterllm.outputs import (
    BeamSearchOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from fasterllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

# a text, a list of token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}
PromptType = Union[str, list[int], dict[str, Any]]
Message = dict[str, Any]


class LLM:
    """Offline generation over a paged KV cache with continuous batching.

    LLM() runs the embedded SmolLM2-135M-Instruct; model= takes a Hugging Face directory, a .gguf
    file or a hub id already in the local cache. Other keyword arguments are EngineArgs fields
    (dtype, device, max_model_len, block_size, gpu_memory_utilization, cpu_kv_cache_gib,
    max_num_seqs, max_num_batched_tokens, seed, ...). LLM(task="embed") runs an encoder for embed() instead
    (default: the embedded all-MiniLM-L6-v2).
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        args = EngineArgs(model=model, **kwargs)
        self.engine = EmbeddingEngine(args) if args.task == "embed" else Engine(args)
        self._ids = itertools.count()

    def get_tokenizer(self) -> TokenizerWrapper:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order."""
        prompt_list = as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        return self._run(prompt_list, params, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate its reply."""
        config = self.engine.model_config
        if config.is_encoder_decoder:
            raise ValueError(f"chat() needs a decoder-only chat model, but {self.engine.model_name} is an encoder-decoder "
                             f"model ({config.architecture}); pass its input text to generate() instead")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("chat() got no conversation; pass a list of {'role', 'content'} messages")
        tokenizer = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.encode_chat(conv, add_generation_prompt, chat_template,
                                                              **template_kwargs)} for conv in conversations]
        return self._run(prompts, _params_per_prompt(sampling_params, len(prompts)), use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search for each prompt (all searches run batched together); each output lists its
        hypotheses best first, by cumulative_logprob / length ** length_penalty."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search() takes BeamSearchParams, got {type(params).__name__}; "
                             "for sampling use generate()")
        prompt_list = as_prompt_list(prompts)
        outputs = self._run(prompt_list, [params] * len(prompt_list), use_tqdm)
        return [BeamSearchOutput(o.prompt, o.prompt_token_ids, o.outputs) for o in outputs]

    def embed(self, prompts: PromptType | Sequence[PromptType], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in input order, pooled as the model's sentence-transformers config says.

        An input longer than max_model_len is an error unless truncate_prompt_tokens is given: -1 keeps the
        last max_model_len tokens, k keeps the last k (text keeps the model's [CLS]/[SEP] around them).
        """
        if not isinstance(self.engine, EmbeddingEngine):
            raise ValueError("embed() needs an embedding model: make the LLM with LLM(model, task='embed')")
        if isinstance(prompts, Sequence) and not isinstance(prompts, str) and len(prompts) == 0:
            raise ValueError("embed() got no inputs; pass a string, a list of strings or token-id lists")
        prompt_list = [prompt_value(p) for p in as_prompt_list(prompts)]
        token_ids = self.engine.tokenize(prompt_list, truncate_prompt_tokens)
        bar = _progress_bar(len(token_ids), use_tqdm)
        try:
            vectors = self.engine.embed(token_ids, on_batch=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        return [EmbeddingRequestOutput(str(next(self._ids)), ids, EmbeddingOutput(vector))
                for ids, vector in zip(token_ids, vectors.tolist())]

    def _run(self, prompts: list[PromptType], params: list[SamplingParams] | list[BeamSearchParams],
             use_tqdm: bool) -> list[RequestOutput]:
        if isinstance(self.engine, EmbeddingEngine):
            raise ValueError(f"this LLM was made with task='embed' ({self.engine.model_name}); use embed(), or make "
                             "a generating LLM without task='embed'")
        request_ids = []
        finished: dict[str, RequestOutput] = {}
        bar = None
        try:  # all prompts are checked before any runs: one bad prompt names itself and runs nothing
            for index, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._ids))
                try:
                    self.engine.add_request(request_id, prompt_value(prompt), p)
                except ValueError as exc:
                    raise ValueError(f"prompt {index}: {exc}") from exc
                request_ids.append(request_id)
            bar = _progress_bar(len(prompts), use_tqdm)
            with heap_frozen_while_generating():
                while len(finished) < len(request_ids):
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            if bar is not None:
                                bar.update(1)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[request_id] for request_id in request_ids]


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """Each prompt's params, asking for its final output only (generate and chat read nothing else): copies, so the
    caller's objects stay as they were; one params object given serves every prompt through one copy."""
    final_only = RequestOutputKind.FINAL_ONLY
    if params is None:
        return [SamplingParams(output_kind=final_only)] * count
    if isinstance(params, SamplingParams):
        return [replace(params, output_kind=final_only)] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt")
    return [replace(p, output_kind=final_only) for p in params]


def _progress_bar(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
