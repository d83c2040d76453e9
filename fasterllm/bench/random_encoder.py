"""A BERT encoder directory with random weights, for benchmarks where no real model can be fetched (GPU machines).

It holds what a real sentence-transformers checkpoint holds: config.json, safetensors, a WordPiece
tokenizer.json (vocabulary: made-up lowercase words) and mean pooling + Normalize, so both fasterllm and
transformers load it as they would a downloaded model.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

ENCODER_SHAPES = {  # name -> (hidden, layers, heads, intermediate)
    "minilm-l6": (384, 6, 12, 1536),
    "bert-base": (768, 12, 12, 3072),
    "bert-large": (1024, 24, 16, 4096),
}
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_random_encoder(directory: Path, shape: str, dtype: torch.dtype = torch.bfloat16, num_words: int = 8000,
                        seed: int = 0) -> Path:
    import transformers
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    if shape not in ENCODER_SHAPES:
        raise ValueError(f"random encoder shape {shape!r} is not known; use one of {', '.join(ENCODER_SHAPES)}")
    hidden, layers, heads, intermediate = ENCODER_SHAPES[shape]
    rng = random.Random(seed)
    words = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
                    for _ in range(num_words)})
    vocab = {token: i for i, token in enumerate(_SPECIAL + words)}
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=intermediate,
                                     max_position_embeddings=512, pad_token_id=0)
    torch.manual_seed(seed)
    transformers.BertModel(config, add_pooling_layer=False).to(dtype).save_pretrained(directory)
    tokenizer = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(directory / "tokenizer.json"))
    files = {
        "tokenizer_config.json": {"tokenizer_class": "BertTokenizerFast", "do_lower_case": True,
                                  "model_max_length": 512, "cls_token": "[CLS]", "sep_token": "[SEP]",
                                  "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"},
        "modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                         {"idx": 2, "name": "2", "path": "2_Normalize",
                          "type": "sentence_transformers.models.Normalize"}],
        "1_Pooling/config.json": {"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True},
        "sentence_bert_config.json": {"max_seq_length": 512},
    }
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(json.dumps(content))
    return directory
