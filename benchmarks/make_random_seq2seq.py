"""Write an encoder-decoder model directory of a real model's shape with random weights, for benchmarks (no hub
needed, and no real encoder-decoder ships in a PyPI package).

    python benchmarks/make_random_seq2seq.py /tmp/marian-base --shape marian-base    # OPUS-MT's shape, ~74M
    python benchmarks/make_random_seq2seq.py /tmp/bart-large --shape bart-large --config-only  # --load-format dummy
    python benchmarks/make_random_seq2seq.py /tmp/bart-tiny --shape bart-tiny    # host-bound: times the host's work

The tokenizer is word-level over the whole vocabulary (make_random_llama.py's): `fasterllm bench` sends token
ids, so only the speed matters. Needs transformers (the test extra).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from make_random_llama import save_word_tokenizer

SHAPES = {
    # Helsinki-NLP/opus-mt-*: 6 + 6 layers, d_model 512, SiLU, scaled embeddings, sinusoidal positions
    "marian-base": ("MarianConfig", dict(vocab_size=58101, decoder_vocab_size=58101, d_model=512, encoder_layers=6,
                                         decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
                                         encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=512,
                                         activation_function="swish", scale_embedding=True, pad_token_id=58100,
                                         decoder_start_token_id=58100, eos_token_id=0)),
    # a BART of 2 + 2 layers, d_model 64 and a 1000-word vocabulary: GEMMs are negligible, so a CPU run times
    # the host's work per step (scheduling, beam bookkeeping, staging)
    "bart-tiny": ("BartConfig", dict(vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_position_embeddings=512)),
    # facebook/bart-large: 12 + 12 layers, d_model 1024, GELU, learned positions
    "bart-large": ("BartConfig", dict(vocab_size=50265, d_model=1024, encoder_layers=12, decoder_layers=12,
                                      encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                                      decoder_ffn_dim=4096, max_position_embeddings=1024)),
    # google/flan-t5-large: 24 + 24 layers, d_model 1024, 16 heads of 64, gated GELU FFN of 2816, untied head
    "flan-t5-large": ("T5Config", dict(vocab_size=32128, d_model=1024, d_kv=64, d_ff=2816, num_layers=24,
                                       num_decoder_layers=24, num_heads=16, feed_forward_proj="gated-gelu",
                                       tie_word_embeddings=False, decoder_start_token_id=0, eos_token_id=1)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="marian-base")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-only", action="store_true",
                        help="config.json and tokenizer only: for --load-format dummy (random weights at load)")
    ns = parser.parse_args()
    import transformers

    config_class, settings = SHAPES[ns.shape]
    config = getattr(transformers, config_class)(**settings)
    config.architectures = [transformers.AutoModelForSeq2SeqLM._model_mapping[type(config)].__name__]
    eos = config.eos_token_id
    if ns.config_only:
        config.save_pretrained(ns.directory)
    else:
        torch.manual_seed(ns.seed)
        model = transformers.AutoModelForSeq2SeqLM.from_config(config)  # initialised N(0, 0.02)
        model.save_pretrained(ns.directory, safe_serialization=True)
        print(f"wrote {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters to {ns.directory}")
    save_word_tokenizer(ns.directory, config.vocab_size, getattr(config, "bos_token_id", None) or eos, eos)


if __name__ == "__main__":
    main()
