"""A Marian directory's SentencePiece files as a `tokenizers` tokenizer: the same ids and text as transformers'
MarianTokenizer, on a unigram model trained here with sentencepiece and a vocab.json numbered as Marian's are
(not in SentencePiece's order, with a piece only the target side knows and a language code)."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from fasterllm.loader.marian_tokenizer import marian_tokenizer

sentencepiece = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

WORDS = ("the cat sat on a mat while seven small dogs ran quickly through green fields and over old bridges "
         "near the quiet river , singing songs about morning light . why ? because 42 birds said so !").split()
TEXTS = ["the cat sat on a mat .", "  seven   small dogs ran  ", "why ? because 42 birds said so !",
         "bridges near the quiet river singing", "unknown letters ß and 日本 here", ">>fr<< the old river",
         "THE CAT", "a mat, a cat; a dog: fine"]


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("marian")
    rng = random.Random(0)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(400)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "spm"), vocab_size=60,
                                             model_type="unigram", character_coverage=1.0)
    shutil.copy(directory / "spm.model", directory / "source.spm")
    shutil.copy(directory / "spm.model", directory / "target.spm")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / "spm.model"))
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    pieces = [p for p in pieces if p not in ("<unk>", "<s>", "</s>")] + ["▁zzonly", ">>fr<<"]
    rng.shuffle(pieces)
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    return directory


def test_ids_and_text_equal_transformers_marian_tokenizer(marian_dir):
    reference = transformers.MarianTokenizer(str(marian_dir / "source.spm"), str(marian_dir / "target.spm"),
                                             str(marian_dir / "vocab.json"))
    ours = marian_tokenizer(marian_dir)
    for text in TEXTS:
        expected = reference(text).input_ids
        assert ours.encode(text).ids == expected, text
        # MarianTokenizer strips its text: a text of unknown pieces only (THE CAT here) decodes to "" there, " " here
        assert ours.decode(expected, skip_special_tokens=True).strip() == reference.decode(expected,
                                                                                          skip_special_tokens=True)
    assert ours.token_to_id("<pad>") == reference.pad_token_id and ours.token_to_id("</s>") == reference.eos_token_id


def test_a_model_other_than_unigram_is_refused(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(WORDS[i:i + 8]) for i in range(len(WORDS))))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "bpe"), vocab_size=40,
                                             model_type="bpe")
    shutil.copy(tmp_path / "bpe.model", tmp_path / "source.spm")
    (tmp_path / "vocab.json").write_text(json.dumps({"</s>": 0, "<unk>": 1}))
    with pytest.raises(ValueError, match="is not a unigram SentencePiece model"):
        marian_tokenizer(tmp_path)


def test_a_marian_directory_without_tokenizer_json_translates_like_transformers(marian_dir, tmp_path):
    """An OPUS-MT-shaped directory (config, weights, source.spm, target.spm, vocab.json; no tokenizer.json): the
    engine tokenizes the text as MarianTokenizer does and greedy tokens equal transformers' generate."""
    import torch

    from fasterllm import LLM, SamplingParams
    from seq2seq_models import hf_generate, randomize_seq2seq_

    for name in ("source.spm", "target.spm", "vocab.json"):
        shutil.copy(marian_dir / name, tmp_path / name)
    vocab = json.loads((marian_dir / "vocab.json").read_text())
    config = transformers.MarianConfig(vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2,
                                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, max_position_embeddings=64, activation_function="swish",
                                       scale_embedding=True, pad_token_id=vocab["<pad>"],
                                       decoder_start_token_id=vocab["<pad>"], eos_token_id=vocab["</s>"],
                                       tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    randomize_seq2seq_(model, 0)
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>",
                                                                "pad_token": "<pad>"}))
    reference = transformers.MarianTokenizer(str(tmp_path / "source.spm"), str(tmp_path / "target.spm"),
                                             str(tmp_path / "vocab.json"))
    text = "the quiet river sat near seven dogs"
    (output,) = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=32).generate(
        text, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert output.encoder_prompt_token_ids == reference(text).input_ids
    expected = hf_generate(model, reference(text).input_ids, 8, eos_token_id=vocab["</s>"])[0, 1:].tolist()
    if vocab["</s>"] in expected:  # padded after its eos
        expected = expected[:expected.index(vocab["</s>"]) + 1]
    assert output.outputs[0].token_ids == expected
