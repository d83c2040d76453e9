"""Marian (OPUS-MT) tokenizers as `tokenizers` objects: those repositories ship SentencePiece models (source.spm,
target.spm) and a vocab.json, no tokenizer.json.

The source model is read with sentencepiece's own protobuf schema (the sentencepiece and protobuf packages), and
its pieces, scores and normalisation rules become a `tokenizers` Unigram model, as tokenizers' and transformers'
SentencePiece converters build one. One thing is Marian's own: the model's ids are vocab.json's, not the
SentencePiece ids, so the pieces are laid out in vocab.json's order (a piece only the target side knows gets a
score below every source piece, so the source segmentation never prefers it). Encoding appends </s>, as
transformers' MarianTokenizer does; >>lang<< codes and the special tokens match as whole tokens.

Checked against transformers' MarianTokenizer (tests/loader/test_marian_tokenizer.py) on a model trained there,
not on a real OPUS-MT directory: none is reachable from here.
"""
from __future__ import annotations

import re
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import Unigram

from fasterllm.loader.hf_checkpoint import read_json

_LANGUAGE_CODE = re.compile(r"^>>.+<<$")
_UNIGRAM = 1  # sentencepiece's TrainerSpec.model_type for a unigram model


def is_marian_directory(directory: Path) -> bool:
    return (directory / "source.spm").is_file() and (directory / "vocab.json").is_file()


def marian_tokenizer(directory: Path) -> Tokenizer:
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as exc:  # protobuf missing too lands here
        raise ValueError(f"{directory} holds a Marian SentencePiece tokenizer (source.spm), which needs the "
                         f"sentencepiece and protobuf packages: pip install sentencepiece protobuf ({exc})") from exc
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((directory / "source.spm").read_bytes())
    if proto.trainer_spec.model_type != _UNIGRAM:
        raise ValueError(f"{directory / 'source.spm'} is not a unigram SentencePiece model (type "
                         f"{proto.trainer_spec.model_type}); only unigram Marian tokenizers are supported")
    vocab: dict[str, int] = read_json(directory / "vocab.json")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"{directory / 'vocab.json'} does not number its {len(vocab)} pieces 0..{len(vocab) - 1}")
    scores = {piece.piece: piece.score for piece in proto.pieces}
    floor = min(scores.values()) - 10.0
    pieces = sorted(vocab, key=vocab.__getitem__)
    tokenizer = Tokenizer(Unigram([(piece, scores.get(piece, floor)) for piece in pieces], vocab["<unk>"], False))
    rules = [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]  # sentencepiece's extra-space rule
    if proto.normalizer_spec.precompiled_charsmap:
        rules.insert(0, normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    tokenizer.normalizer = normalizers.Sequence(rules)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in ("</s>", "<unk>", "<pad>")
                                  if piece in vocab])
    # matched whole, kept in decoded text (transformers' MarianTokenizer does not count them as special)
    tokenizer.add_tokens([AddedToken(piece, normalized=False) for piece in pieces if _LANGUAGE_CODE.match(piece)])
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return tokenizer
