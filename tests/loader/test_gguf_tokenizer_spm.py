"""GGUF files with a SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma, Phi-3) get their
tokenizer from the file. SentencePiece models are trained here the way Llama's was (BPE, byte fallback, digits split,
no normalization, whitespace-only pieces), written into GGUF files as llama.cpp's converter writes them (tokens,
scores, token types, special ids, flags), and our tokenizer built from the file gives SentencePiece's own ids;
`LLM(file)` generates as it does with transformers' tokenizer of the same model as tokenizer=."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from test_gguf import SHAPE, randomized, write_gguf
from transformers import LlamaConfig, LlamaForCausalLM, LlamaTokenizer

from fasterllm import LLM, SamplingParams
from fasterllm.loader.gguf_checkpoint import GGUFFile
from fasterllm.loader.tokenizer import load_gguf_tokenizer

sentencepiece = pytest.importorskip("sentencepiece")

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
BOS, EOS, END, USER = 1, 2, 3, 4  # <s>, </s>, <|end|> (a control token), <|user|> (a user-defined one)
TEXT = Path(__file__).parents[1] / "data" / "pride_and_prejudice_ch1.txt"
EXTRA_LINES = ["    def f(x):  return x + 1", "        if year == 2024:", "  indented   spaced    words",
               "price: 12345.67 dollars", "café naïve résumé"]
TEXTS = ["", " ", "   ", "Hello world", " Hello", "  two leading, trailing  ", "a  b   c    d",
         "It is a truth universally acknowledged", "line one\nline two\n\n", "\ttab\tseparated\t",
         "digits 1234567890 and 3.14159", "unicode: 日本語, emoji 🙂, Ωmega, café", "\n", "naïve résumé",
         'He said, "my dear Mr. Bennet," and left.']
SPECIAL_TEXTS = ["Hi<|end|>there", "<|end|>", "<s>[INST] hello [/INST]", "x<|user|>y", "a <|end|> <|user|>  b</s>",
                 "<|end|><|end|>"]
LLAMA2_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                   "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = TEXT.read_text().split() + ["日本", "é", "🙂", "\n", "\t", "123", "4567", "ÆØÅ", "<", "|"]
    return ["".join(rng.choice([rng.choice(words), " ", "  ", "\n"]) for _ in range(rng.randint(1, 16)))
            for _ in range(count)]


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory) -> dict[str, Path]:
    """Llama-like SentencePiece models: BPE with the dummy space prefix (Llama 2, Mistral), BPE without it (Gemma)
    and a unigram one."""
    directory = tmp_path_factory.mktemp("spm")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(TEXT.read_text().splitlines() + EXTRA_LINES * 5))
    paths = {}
    for name, model_type, prefix in (("bpe", "bpe", True), ("bpe_no_prefix", "bpe", False),
                                     ("unigram", "unigram", True)):
        sentencepiece.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(directory / name), vocab_size=500, model_type=model_type,
            byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False, normalization_rule_name="identity", add_dummy_prefix=prefix,
            control_symbols=["<|end|>"], user_defined_symbols=["<|user|>"], unk_id=0, bos_id=BOS, eos_id=EOS,
            pad_id=-1, minloglevel=2)
        paths[name] = directory / f"{name}.model"
    return paths


def spm_vocabulary(sp, add_space_prefix: bool | None = None, add_bos: bool | None = True,
                   add_eos: bool | None = None, chat_template: str | None = None):
    """What llama.cpp's convert_hf_to_gguf.py writes for a SentencePiece tokenizer, as a write_gguf vocabulary."""
    def kind(i: int) -> int:
        return (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else UNUSED if sp.is_unused(i)
                else BYTE if sp.is_byte(i) else USER_DEFINED if sp.id_to_piece(i) == "<|user|>" else NORMAL)

    def write(writer: GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
        writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
        writer.add_token_types([kind(i) for i in range(sp.get_piece_size())])
        writer.add_bos_token_id(BOS)
        writer.add_eos_token_id(EOS)
        writer.add_unk_token_id(0)
        for flag, add in ((add_space_prefix, writer.add_add_space_prefix), (add_bos, writer.add_add_bos_token),
                          (add_eos, writer.add_add_eos_token), (chat_template, writer.add_chat_template)):
            if flag is not None:
                add(flag)
    return write


def write_vocab_only(path: Path, sp, arch: str = "llama", **flags) -> Path:
    writer = GGUFWriter(str(path), arch)
    spm_vocabulary(sp, **flags)(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def gguf_tokenizer(path: Path, sp, **flags):
    """Our tokenizer, read from a GGUF file holding only the vocabulary (through the loader's own reader)."""
    return load_gguf_tokenizer(GGUFFile(write_vocab_only(path, sp, **flags)).metadata, [])


def segments_encoded(sp, text: str, encode) -> list[int]:
    """llama.cpp's rule for special tokens in the text: each is its own id, and the text between them is encoded
    alone (with its own space prefix)."""
    specials = {"<s>": BOS, "</s>": EOS, "<|end|>": END, "<|user|>": USER}
    ids, rest = [], text
    while rest:
        found = min(((rest.find(s), s) for s in specials if s in rest), default=None)
        if found is None:
            return ids + encode(rest)
        index, special = found
        ids += (encode(rest[:index]) if index else []) + [specials[special]]
        rest = rest[index + len(special):]
    return ids


def llama_cpp_spm(text: str, pieces: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm, written again from what it does: spaces become "▁"; merge the adjacent pair
    whose joined text is the token of highest score (the leftmost of equal ones) until no pair joins into a token;
    a leftover character that is no token becomes its UTF-8 bytes' <0xNN> tokens."""
    ids = {piece: i for i, piece in enumerate(pieces)}
    symbols = list(text.replace(" ", SPACE))
    while True:
        best, best_score = None, None
        for i in range(len(symbols) - 1):
            joined = ids.get(symbols[i] + symbols[i + 1])
            if joined is not None and (best is None or scores[joined] > best_score):
                best, best_score = i, scores[joined]
        if best is None:
            break
        symbols[best:best + 2] = [symbols[best] + symbols[best + 1]]
    return [i for s in symbols for i in ([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])]


def test_bpe_ids_equal_sentencepiece(sp_models, tmp_path):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models["bpe"]))
    ours = gguf_tokenizer(tmp_path / "v.gguf", sp)
    for text in TEXTS + random_texts(200, seed=0):
        assert ours.encode(text, add_special_tokens=False) == sp.encode(text), repr(text)
        assert ours.encode(text) == [BOS] + sp.encode(text), repr(text)  # add_bos_token
        assert ours.decode(ours.encode(text)) == text, repr(text)
    # a character the vocabulary lacks falls back to its bytes, which decode to it again
    ids = ours.encode("日本", add_special_tokens=False)
    assert [sp.id_to_piece(i) for i in ids] == [SPACE, "<0xE6>", "<0x97>", "<0xA5>", "<0xE6>", "<0x9C>", "<0xAC>"]


def test_special_tokens_in_the_text_match_whole(sp_models, tmp_path):
    """Control and user-defined tokens written in the text are their own ids (as in llama.cpp; SentencePiece itself
    would spell a control token out in bytes), each stretch between them encoded with its own space prefix;
    decoding drops the control tokens unless asked to keep them."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models["bpe"]))
    ours = gguf_tokenizer(tmp_path / "v.gguf", sp)
    for text in SPECIAL_TEXTS:
        assert ours.encode(text, add_special_tokens=False) == segments_encoded(sp, text, sp.encode), text
    ids = ours.encode("Hi<|end|>there<|user|>")
    assert ids[0] == BOS and END in ids and ids[-1] == USER
    assert ours.decode(ids) == "Hi there<|user|>"  # as SentencePiece decodes each stretch: the prefix is a space
    assert ours.decode(ids, skip_special_tokens=False) == "<s> Hi<|end|> there<|user|>"
    assert ours.special_ids == {0, BOS, EOS, END}


def test_no_space_prefix_and_bos_eos_flags(sp_models, tmp_path):
    """add_space_prefix false (Gemma's files) against a model trained without the dummy prefix; add_bos_token and
    add_eos_token as the file sets them, BOS by default (llama.cpp's default for this vocabulary)."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models["bpe_no_prefix"]))
    ours = gguf_tokenizer(tmp_path / "default-bos.gguf", sp, add_space_prefix=False, add_bos=None)
    for text in TEXTS + random_texts(50, seed=1):
        assert ours.encode(text) == [BOS] + sp.encode(text), repr(text)
        assert ours.decode(ours.encode(text)) == text, repr(text)
    ours = gguf_tokenizer(tmp_path / "eos.gguf", sp, add_space_prefix=False, add_bos=False, add_eos=True)
    assert ours.encode("Hello") == sp.encode("Hello") + [EOS]
    assert ours.encode("") == [EOS]


def test_phi3_special_tokens_take_the_whitespace_after_them(sp_models, tmp_path):
    """Phi-3's tokenizer strips the whitespace after its special tokens, except after <s> (as llama.cpp does for
    it): its chat template's "<|user|>\n" is one token."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models["bpe"]))
    ours = gguf_tokenizer(tmp_path / "phi3.gguf", sp, arch="phi3")
    assert ours.encode("<|end|>\nHi <|user|>  there", add_special_tokens=False) == \
        [END] + sp.encode("Hi ") + [USER] + sp.encode("there")
    assert ours.encode("<s>\nHi", add_special_tokens=False) == [BOS] + sp.encode("\nHi")


def test_unigram_vocabulary_merges_by_score_as_llama_cpp_does(sp_models, tmp_path):
    """llama.cpp tokenizes any "llama" vocabulary by merging pairs by score, a unigram one too (which SentencePiece
    itself would segment otherwise: the file does not say which it was); ours equals that rule written out."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models["unigram"]))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(sp.get_piece_size())]
    ours = gguf_tokenizer(tmp_path / "v.gguf", sp)
    for text in TEXTS + random_texts(100, seed=2):
        expected = llama_cpp_spm(" " + text, pieces, scores) if text else []
        assert ours.encode(text, add_special_tokens=False) == expected, repr(text)
        assert ours.decode(ours.encode(text)) == text, repr(text)
    for text in SPECIAL_TEXTS:
        expected = segments_encoded(sp, text, lambda part: llama_cpp_spm(" " + part, pieces, scores))
        assert ours.encode(text, add_special_tokens=False) == expected, text


def test_unsupported_or_incomplete_vocabulary_is_named(sp_models, tmp_path):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models["bpe"]))
    metadata = dict(GGUFFile(write_vocab_only(tmp_path / "v.gguf", sp)).metadata)
    with pytest.raises(ValueError, match=r"tokenizer type 't5' \(tokenizer.ggml.model\) is not supported; supported: "
                                         r"'gpt2' .* and 'llama' .* Pass tokenizer= the model's Hugging Face"):
        load_gguf_tokenizer({**metadata, "tokenizer.ggml.model": "t5"}, [])
    tokens = list(metadata["tokenizer.ggml.tokens"])
    tokens[300] = tokens[400]
    duplicate = re.escape(repr(tokens[400]))
    with pytest.raises(ValueError, match=rf"lists the token {duplicate} twice \(ids 300 and 400\).*tokenizer="):
        load_gguf_tokenizer({**metadata, "tokenizer.ggml.tokens": tokens}, [])
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(ValueError, match=r"has 500 tokens but no scores \(tokenizer.ggml.scores\).*pass tokenizer="):
        load_gguf_tokenizer(metadata, [])


@pytest.fixture(scope="module")
def spm_model_files(sp_models, tmp_path_factory):
    """A tiny random Llama with the BPE vocabulary as a GGUF (Llama 2's chat template in it, no eot id: <|end|> is
    found by its text), and a Hugging Face directory with transformers' tokenizer of the same SentencePiece model."""
    directory = tmp_path_factory.mktemp("spm-llama")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_models["bpe"]))
    torch.manual_seed(0)
    model = randomized(LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": sp.get_piece_size(),
                                                       "eos_token_id": EOS, "bos_token_id": BOS})))
    path = directory / "tiny-spm.gguf"
    write_gguf(path, model, GGMLQuantizationType.F32, vocabulary=spm_vocabulary(sp, chat_template=LLAMA2_TEMPLATE))
    source = directory / "sp"
    source.mkdir()
    (source / "tokenizer.model").write_bytes(sp_models["bpe"].read_bytes())
    reference = LlamaTokenizer.from_pretrained(str(source), legacy=True, add_bos_token=True)
    reference.chat_template = LLAMA2_TEMPLATE
    reference.save_pretrained(str(directory / "hf"))
    model.config.save_pretrained(str(directory / "hf"))  # tokenizer= takes a model directory
    return path, directory / "hf", sp


def test_llm_generates_from_the_gguf_alone_as_with_the_hf_tokenizer(spm_model_files):
    path, hf_dir, sp = spm_model_files
    ours = LLM(str(path), dtype="float32", cpu_kv_cache_gib=0.01)
    reference = LLM(str(path), tokenizer=str(hf_dir), dtype="float32", cpu_kv_cache_gib=0.01)
    # transformers' converted tokenizer drops SentencePiece's extra space before a text that starts with one, so
    # these prompts do not
    prompts = ["It is a truth universally acknowledged", "Mr. Bennet replied 12345 日本\nthat he had not."]
    params = SamplingParams(temperature=0, max_tokens=12)
    for prompt, mine, theirs in zip(prompts, ours.generate(prompts, params, use_tqdm=False),
                                    reference.generate(prompts, params, use_tqdm=False)):
        assert mine.prompt_token_ids == [BOS] + sp.encode(prompt) == theirs.prompt_token_ids
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids and mine.outputs[0].token_ids
        assert mine.outputs[0].text == theirs.outputs[0].text
    chat = [{"role": "user", "content": "Who is Mr. Bennet?"}, {"role": "assistant", "content": "A father."},
            {"role": "user", "content": "And Mrs. Bennet?"}]
    mine, theirs = ours.chat(chat, params, use_tqdm=False)[0], reference.chat(chat, params, use_tqdm=False)[0]
    assert mine.prompt_token_ids == theirs.prompt_token_ids and mine.prompt_token_ids.count(BOS) == 1
    assert mine.prompt_token_ids[0] == BOS and mine.prompt_token_ids.count(EOS) == 1
    assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
    # the eos and the end of turn the file names by text only stop generation
    assert ours.engine.tokenizer.eos_token_ids == [EOS, END]
