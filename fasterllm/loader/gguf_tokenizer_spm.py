"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Mixtral, Gemma, Phi-3) as
a `tokenizers` tokenizer that encodes as llama.cpp's SPM tokenizer does, which is what SentencePiece itself gives on
a BPE model.

llama.cpp's rules, and how each is built here:
- Spaces become "▁" and every stretch of text gets a "▁" in front (at the start and after each special token)
  unless `tokenizer.ggml.add_space_prefix` is false (Gemma): a Prepend + Replace normalizer, which `tokenizers`
  runs on each stretch between added tokens. (A Metaspace pre-tokenizer would not do: it skips the prefix when the
  text already starts with a space.)
- The stretch is merged pair by pair, always the adjacent pair whose joined text is the token of highest score:
  BPE merges made from the vocabulary, one per way of cutting a token in two known tokens, ranked by that token's
  score. No pre-tokenizer: SentencePiece merges across words, "▁▁▁" included.
- A character no token covers becomes its UTF-8 bytes' `<0xNN>` tokens (byte fallback).
- Control and unknown tokens are matched whole in the text as special tokens, user-defined ones as plain added
  tokens (both on the raw text, before the spaces are replaced); decoding skips the special ones on request.
The file does not say whether SentencePiece trained the vocabulary as BPE or unigram; llama.cpp merges by score
either way, and so does this (on a unigram vocabulary that differs from SentencePiece's own Viterbi segmentation,
as it does in llama.cpp).
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, normalizers
from tokenizers.models import BPE

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"
# Phi-3's tokenizer strips the whitespace after its special tokens ("<|user|>\n" is one token), except these
# (llama.cpp sets the same by model name)
_PHI3_UNSTRIPPED = ("<unk>", "<s>", "<|endoftext|>")


def sentencepiece_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(f"This GGUF's SentencePiece vocabulary has {len(tokens)} tokens but "
                         f"{'no' if scores is None else len(scores)} scores (tokenizer.ggml.scores), which its merges "
                         "are ranked by; the file is incomplete: pass tokenizer= a Hugging Face directory")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        duplicate = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise ValueError(f"This GGUF's vocabulary lists the token {duplicate!r} twice (ids {tokens.index(duplicate)} "
                         f"and {vocab[duplicate]}); the file is corrupt: pass tokenizer= a Hugging Face directory")
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None and UNKNOWN in types:
        unk_id = types.index(UNKNOWN)
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=_merges(tokens, scores, types, vocab),
                              unk_token=None if unk_id is None else tokens[unk_id], fuse_unk=True,
                              byte_fallback=BYTE in types))
    space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    tokenizer.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE)] if space_prefix else []) + [normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))  # the prefix's space goes again
    phi3 = metadata.get("general.architecture") == "phi3"

    def added(token: str, special: bool) -> AddedToken:
        return AddedToken(token, special=special, normalized=False, rstrip=phi3 and token not in _PHI3_UNSTRIPPED)

    tokenizer.add_special_tokens([added(t, True) for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)])
    tokenizer.add_tokens([added(t, False) for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return tokenizer


def _merges(tokens: list[str], scores: list[float], types: list[int],
            vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) whose joined text is a token, best token score first: the order llama.cpp's SPM
    tokenizer merges pairs in. Control, unknown, byte and user-defined tokens are never merged into (the first three
    are not text, the last are matched whole before merging)."""
    ranked = []
    for token_id, token in enumerate(tokens):
        if types[token_id] not in (NORMAL, UNUSED):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
