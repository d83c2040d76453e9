"""Tokenizers from a Hugging Face directory or from GGUF metadata, and chat templates rendered with jinja2."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

from fasterllm.loader.gguf_tokenizer_spm import sentencepiece_tokenizer
from fasterllm.loader.hf_checkpoint import read_json
from fasterllm.loader.marian_tokenizer import is_marian_directory, marian_tokenizer

_GGUF_CONTROL_TOKEN = 3

# Pre-tokenizer splits for GGUF `tokenizer.ggml.pre` values whose merges were learned on a split
# other than GPT-2's; the rest get GPT-2's byte-level split, as transformers' GGUF loader does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _byte_alphabet() -> dict[str, int]:
    """The character a byte-level BPE writes for each byte (GPT-2's alphabet), inverted: the printable bytes of
    Latin-1 stand for themselves, every other byte, in order, for the next code point from 256 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + i): byte for i, byte in enumerate(others)}}


_BYTE_OF_CHAR = _byte_alphabet()


class TokenizerWrapper:
    """Encode, decode and render chat prompts; the one tokenizer API the engine uses."""

    def __init__(self, tokenizer: Tokenizer, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, extra_eos_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        eos_ids = {self.eos_token_id} | set(extra_eos_ids or [])
        self.eos_token_ids = sorted(i for i in eos_ids if i is not None)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._single_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})  # decode_one's, by skip_special_tokens
        # token_bytes' pieces, by skip_special_tokens; None: this decoder's text is not a function of bytes alone
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] | None = \
            ({}, {}) if isinstance(tokenizer.decoder, decoders.ByteLevel) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids (special tokens included) of each text, from one call: the Rust tokenizer spreads the
        texts over the cores, and skips the character offsets we never read (~20% of its time)."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts)]

    @property
    def num_special_tokens(self) -> int:
        """How many special tokens encode() adds around one text (BERT: [CLS] and [SEP])."""
        return self.tokenizer.num_special_tokens_to_add(is_pair=False)

    def encode_last(self, text: str, max_tokens: int) -> list[int]:
        """Token ids of the text's last tokens, with the special tokens around them, max_tokens in all (as vLLM
        truncates: the end of a text is kept); max_tokens must leave room beside the special tokens."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        encoding.truncate(max_tokens - self.num_special_tokens, direction="left")
        return self.tokenizer.post_process(encoding).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """decode([token_id]), kept once computed: a token's text alone depends on nothing else, and the incremental
        detokenizer asks for it once per generated token."""
        texts = self._single_texts[skip_special_tokens]
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    @property
    def decodes_bytes(self) -> bool:
        """Whether token_bytes may give each token's bytes (a byte-level BPE decoder, none found to disagree yet)."""
        return self._pieces is not None

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes | None:
        """The bytes a byte-level BPE decoder (GPT-2's and its descendants') writes for this token, or None where the
        decoder is another kind. Such a decoder maps each character of each token to one byte and decodes all the
        bytes as UTF-8 at once, so a text is the tokens' bytes joined: the incremental detokenizer then decodes them
        itself, where a call into the tokenizer costs ~3-5 us a token. Each token's bytes are checked against the
        tokenizer's own decode of it when first asked for; a token that disagrees turns this off for good."""
        both = self._pieces  # read once: another thread may turn it off meanwhile
        if both is None:
            return None
        pieces = both[bool(skip_special_tokens)]
        piece = pieces.get(token_id)
        if piece is None:
            skipped = skip_special_tokens and token_id in self.special_ids
            token = None if skipped else self.tokenizer.id_to_token(token_id)
            try:
                piece = b"" if token is None else bytes(_BYTE_OF_CHAR[char] for char in token)
            except KeyError:  # a character outside the byte alphabet (an added token's text): kept as it is
                piece = token.encode()
            if piece.decode("utf-8", "replace") != self.decode_one(token_id, skip_special_tokens):
                self._pieces = None
                return None
            pieces[token_id] = piece
        return piece

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("This model has no chat template (none in tokenizer_config.json or the GGUF metadata); "
                             "pass chat_template=... or use generate() with a plain prompt")
        _check_messages(messages)
        return _compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None, **kwargs: Any) -> list[int]:
        """Token ids of a conversation in the chat template; the template writes the special tokens itself."""
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}]={message!r} must be a dict with 'role' and 'content'")


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compile_template(source: str):
    if source not in _TEMPLATE_CACHE:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATE_CACHE[source] = env.from_string(source)
    return _TEMPLATE_CACHE[source]


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_hf_tokenizer(model_dir: Path, extra_eos_ids: list[int]) -> TokenizerWrapper:
    """tokenizer.json, or a Marian directory's SentencePiece files (loader/marian_tokenizer.py)."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        tokenizer = Tokenizer.from_file(str(path))
    elif is_marian_directory(model_dir):
        tokenizer = marian_tokenizer(model_dir)
    else:
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json; fasterllm needs a fast tokenizer file "
                                "(save one with transformers' AutoTokenizer(...).save_pretrained)")
    # some tokenizer.json files carry padding/truncation (all-MiniLM-L6-v2: pad and cut to 128); the
    # engine checks lengths itself and never pads
    tokenizer.no_padding()
    tokenizer.no_truncation()
    config_path = model_dir / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    template = config.get("chat_template")
    template_file = model_dir / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return TokenizerWrapper(tokenizer, bos_token=_token_content(config.get("bos_token")),
                            eos_token=_token_content(config.get("eos_token")),
                            chat_template=template, extra_eos_ids=extra_eos_ids)


def load_gguf_tokenizer(metadata: dict[str, Any], extra_eos_ids: list[int]) -> TokenizerWrapper:
    """The tokenizer a GGUF's metadata describes: byte-level BPE ('gpt2': SmolLM2, Llama 3, Qwen) or SentencePiece
    ('llama': Llama 2, Mistral, Gemma, Phi-3; loader/gguf_tokenizer_spm.py)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata)
    elif kind == "llama":
        tokenizer = sentencepiece_tokenizer(metadata)
    else:
        raise ValueError(f"GGUF tokenizer type {kind!r} (tokenizer.ggml.model) is not supported; supported: 'gpt2' "
                         "(byte-level BPE) and 'llama' (SentencePiece). Pass tokenizer= the model's Hugging Face "
                         "directory (with tokenizer.json) instead")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    # llama.cpp's defaults where the file has no flag: a SentencePiece vocabulary gets a BOS, a byte-level one not
    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    before, after = [bos] * add_bos, [eos] * add_eos
    if before or after:
        def template(sequence: str, type_id: int) -> str:
            return " ".join(f"{piece}:{type_id}" for piece in before + [sequence] + after)

        ids = [(bos, metadata["tokenizer.ggml.bos_token_id"])] * add_bos + \
            [(eos, metadata["tokenizer.ggml.eos_token_id"])] * add_eos
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template("$A", 0), pair=f"{template('$A', 0)} {template('$B', 1)}", special_tokens=ids)
    return TokenizerWrapper(tokenizer, bos_token=bos, eos_token=eos,
                            chat_template=metadata.get("tokenizer.chat_template"), extra_eos_ids=extra_eos_ids)


def _byte_level_bpe(metadata: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                              fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""))
    split = _GGUF_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, kind in zip(tokens, types) if kind == _GGUF_CONTROL_TOKEN])
    return tokenizer
