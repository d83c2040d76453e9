"""Every prompt check, in one place, for the offline API, the server and both engines (generate and embed).

A prompt becomes token ids here, is checked against the vocabulary and the context length here, and a bad one
raises InvalidInputError naming its field ("prompt", "input", "max_tokens", ...), which the server reports as the
error's "param". Nothing here runs the model.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fasterllm.errors import InvalidInputError
from fasterllm.sampling_params import SamplingParams
from fasterllm.seq2seq_config import Seq2SeqConfig, T5Config


def check_token_ids(token_ids: list, vocab_size: int, what: str, param: str | None = None) -> None:
    """Every id an int (not a bool) in the vocabulary; the error shows the first bad ones, named as `what`."""
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidInputError(f"{what} {bad[:5]} are not valid: ids must be integers in [0, {vocab_size})", param)


def as_prompt_list(prompts: Any) -> list:
    """The offline API's prompts argument as a list: one string, one token-id list or one dict is one prompt."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise InvalidInputError("generate() got no prompts; pass a string, a list of strings or token-id lists",
                                "prompts")
    return prompts


def prompt_value(prompt: Any) -> str | list[int] | dict:
    """A text or token ids out of an offline prompt (a string, a token-id list, or vLLM's dict form); an
    encoder-decoder prompt ({"encoder_prompt": ..., "decoder_prompt": ...}) as it is."""
    if isinstance(prompt, dict) and ("encoder_prompt" in prompt or "decoder_prompt" in prompt):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise InvalidInputError(f"prompt dict {prompt!r} needs a 'prompt' or 'prompt_token_ids' key", "prompt")
    if isinstance(prompt, (str, list)):
        return prompt
    raise InvalidInputError(f"prompt of type {type(prompt).__name__} is not supported; pass a string or a list of "
                            "token ids", "prompt")


@dataclass
class GenerationInputs:
    """A request's token streams: the prompt's, and an encoder-decoder model's encoder input (then the prompt is
    the decoder's: its start token and any decoder prompt)."""
    prompt: str | None
    token_ids: list[int]
    encoder_prompt: str | None = None
    encoder_token_ids: list[int] | None = None


class InputProcessor:
    """The checks that need the model: its tokenizer, vocabulary and context length (max_model_len); for an
    encoder-decoder model (seq2seq), its encoder's limit and its decoder's start tokens."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 seq2seq: Seq2SeqConfig | T5Config | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.seq2seq = seq2seq

    @classmethod
    def for_model(cls, tokenizer, config, max_model_len: int) -> InputProcessor:
        """The checks for a model of this config (a decoder-only model's config or an encoder-decoder one's)."""
        return cls(tokenizer, config.vocab_size, max_model_len, config if config.is_encoder_decoder else None)

    # ---- generation --------------------------------------------------------------------------------
    def generation_inputs(self, prompt: str | list[int] | dict) -> GenerationInputs:
        """What a generation request runs on. A decoder-only model takes a text or token ids; an encoder-decoder
        one takes those as its encoder input, or {"encoder_prompt": ..., "decoder_prompt": ...} (each a text or
        token ids; the decoder prompt optional)."""
        if self.seq2seq is not None:
            return self._encoder_decoder_inputs(prompt)
        if isinstance(prompt, dict):
            raise InvalidInputError("encoder_prompt / decoder_prompt are for encoder-decoder models; this model is "
                                    "decoder-only: pass the prompt as a string or token ids", "prompt")
        return GenerationInputs(*self.generation_prompt(prompt))

    def _encoder_decoder_inputs(self, prompt: str | list[int] | dict) -> GenerationInputs:
        """The encoder's tokens (the text's special tokens included) within the encoder's positions; the decoder's:
        decoder_start_token_id, then the token the model's config forces first (if any) or the decoder prompt's."""
        cfg = self.seq2seq
        encoder, decoder = (prompt.get("encoder_prompt"), prompt.get("decoder_prompt")) if isinstance(prompt, dict) \
            else (prompt, None)
        if encoder is None:
            raise InvalidInputError("an encoder-decoder prompt needs an 'encoder_prompt' (a text or token ids)",
                                    "prompt")
        encoder_text, encoder_ids = self._prompt_tokens(encoder, "encoder prompt", add_special_tokens=True)
        if len(encoder_ids) > cfg.max_encoder_len:
            raise InvalidInputError(
                f"The encoder prompt has {len(encoder_ids)} tokens but this model's encoder takes at most "
                f"{cfg.max_encoder_len} (max_position_embeddings); shorten it", "prompt")
        if decoder is None:
            decoder_text, decoder_ids = None, self._decoder_start_ids()
        else:
            decoder_text, ids = self._prompt_tokens(decoder, "decoder prompt", add_special_tokens=False)
            start = [cfg.decoder_start_token_id]
            decoder_ids = ids if ids[:1] == start else start + ids
        if len(decoder_ids) >= self.max_model_len:
            raise InvalidInputError(
                f"The decoder prompt has {len(decoder_ids)} tokens but max_model_len is {self.max_model_len} (room for "
                "at least one generated token is needed); shorten it or raise max_model_len", "prompt")
        return GenerationInputs(decoder_text, decoder_ids, encoder_text, encoder_ids)

    def _decoder_start_ids(self) -> list[int]:
        forced = self.seq2seq.forced_bos_token_id
        return [self.seq2seq.decoder_start_token_id] + ([] if forced is None else [forced])

    def _prompt_tokens(self, prompt: Any, what: str, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            prompt = prompt_value(prompt)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, list):
            text, token_ids = None, list(prompt)
            check_token_ids(token_ids, self.vocab_size, f"{what} token ids", "prompt")
        else:
            raise InvalidInputError(f"the {what} of type {type(prompt).__name__} is not supported; pass a string or "
                                    "a list of token ids", "prompt")
        if not token_ids:
            raise InvalidInputError(f"The {what} is empty; give at least one character (or token id)", "prompt")
        return text, token_ids

    def generation_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt to generate from: non-empty, ids in the vocabulary, and shorter
        than max_model_len (room for at least one generated token)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("The prompt is empty; give at least one character (or token id)", "prompt")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            check_token_ids(token_ids, self.vocab_size, "prompt token ids", "prompt")
        if not token_ids:
            raise InvalidInputError("The prompt has no tokens; give at least one", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidInputError(
                f"The prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} (room for at least "
                "one generated token is needed); shorten the prompt or raise max_model_len (--max-model-len)", "prompt")
        return text, token_ids

    def generation_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        """The server's completions prompt field (a text, texts, token ids or token-id lists) as token-id lists;
        an empty one is named by its index."""
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise InvalidInputError("prompt is an empty list; give a string, a list of strings or token ids", "prompt")
        token_lists = []
        for i, one in enumerate(prompt):
            ids = self.tokenizer.encode(one) if isinstance(one, str) else list(one)
            if not ids:
                raise InvalidInputError(f"prompt {i} is empty; give at least one character (or token id)", "prompt")
            token_lists.append(ids)
        return token_lists

    def check_generation_length(self, prompt_len: int, max_tokens: int | None, prompt_field: str,
                                max_tokens_field: str) -> None:
        """The server's rule: a prompt that leaves no room, or max_tokens past the context, is refused (the offline
        engine caps max_tokens at the room left instead). An encoder-decoder model's prompt is its encoder's input,
        and max_tokens counts against the decoder's context."""
        limit = self.max_model_len
        if self.seq2seq is not None:
            if prompt_len > self.seq2seq.max_encoder_len:
                raise InvalidInputError(f"This model's encoder takes at most {self.seq2seq.max_encoder_len} tokens, but "
                                        f"the {prompt_field} has {prompt_len}; shorten the {prompt_field}", prompt_field)
            prompt_len = len(self._decoder_start_ids())  # what the decoder's context holds before generating
        if prompt_len >= limit:
            raise InvalidInputError(
                f"This model's maximum context length is {limit} tokens, but the {prompt_field} has {prompt_len} "
                f"tokens (room for at least one generated token is needed); shorten the {prompt_field}", prompt_field)
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise InvalidInputError(
                f"{max_tokens_field}={max_tokens} is too large: the {prompt_field} has {prompt_len} tokens and this "
                f"model's maximum context length is {limit}, so {max_tokens_field} can be at most "
                f"{limit - prompt_len}", max_tokens_field)

    def check_sampling_token_ids(self, params: SamplingParams) -> None:
        """The token ids a request's parameters name lie in the vocabulary."""
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", list(params.logit_bias or {}))):
            bad = [t for t in ids or [] if t >= self.vocab_size]
            if bad:
                raise InvalidInputError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})",
                                        name)

    def bad_word_ids(self, words: list[str] | None) -> list[list[int]]:
        """Each bad word as token ids, as written and with a leading space (how it appears mid-text)."""
        sequences: list[list[int]] = []
        for word in words or []:
            for form in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(form, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    # ---- embeddings --------------------------------------------------------------------------------
    def embedding_inputs(self, prompts: Sequence[str | list[int]],
                         truncate_prompt_tokens: int | None = None) -> list[list[int]]:
        """Token ids of every input to embed, checked (at most max_model_len each, or truncated to the last
        truncate_prompt_tokens; -1: max_model_len); an error names the input's index."""
        keep = self._truncation_length(truncate_prompt_tokens)
        batch_encoded = self._encode_texts_at_once(prompts, keep)
        token_ids = []
        for index, prompt in enumerate(prompts):
            ids = batch_encoded.get(index)
            if ids is None:  # token ids, or a text that must be truncated or refused: checked one by one
                try:
                    ids = self._embedding_input(prompt, keep)
                except InvalidInputError as exc:
                    raise InvalidInputError(f"input {index}: {exc}", exc.param) from exc
            token_ids.append(ids)
        return token_ids

    def _encode_texts_at_once(self, prompts: Sequence[str | list[int]], keep: int | None) -> dict[int, list[int]]:
        """Index -> token ids (special tokens included) of every non-empty text that fits as it is, from one
        encode_batch call: the Rust tokenizer spreads the texts over the cores instead of one call each."""
        if keep is not None and keep <= self.tokenizer.num_special_tokens:
            return {}  # _embedding_input names that error
        limit = self.max_model_len if keep is None else keep
        texts = [index for index, prompt in enumerate(prompts) if isinstance(prompt, str) and prompt]
        encoded = self.tokenizer.encode_batch([prompts[i] for i in texts])
        return {index: ids for index, ids in zip(texts, encoded) if 0 < len(ids) <= limit}

    def _truncation_length(self, truncate_prompt_tokens: int | None) -> int | None:
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self.max_model_len
        if not 1 <= truncate_prompt_tokens <= self.max_model_len:
            raise InvalidInputError(f"truncate_prompt_tokens={truncate_prompt_tokens} must be -1 (the model's limit) "
                                    f"or in [1, max_model_len={self.max_model_len}]", "truncate_prompt_tokens")
        return truncate_prompt_tokens

    def _embedding_input(self, prompt: str | list[int], keep: int | None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInputError("the text is empty; give at least one character", "input")
            special = self.tokenizer.num_special_tokens
            if keep is not None and keep <= special:
                raise InvalidInputError(f"truncate_prompt_tokens={keep} leaves no room for text beside the model's "
                                        f"{special} special tokens; keep at least {special + 1}",
                                        "truncate_prompt_tokens")
            token_ids = self.tokenizer.encode(prompt) if keep is None else self.tokenizer.encode_last(prompt, keep)
        elif isinstance(prompt, list):
            check_token_ids(prompt, self.vocab_size, "token ids", "input")
            token_ids = prompt[-keep:] if keep is not None else list(prompt)
        else:
            raise InvalidInputError(f"an input of type {type(prompt).__name__} is not supported; pass a string or a "
                                    "list of token ids", "input")
        if not token_ids:
            raise InvalidInputError("the input has no tokens; give at least one", "input")
        if len(token_ids) > self.max_model_len:
            raise InvalidInputError(f"the input has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                                    "shorten it, or pass truncate_prompt_tokens=-1 to keep its last "
                                    f"{self.max_model_len} tokens", "input")
        return token_ids
