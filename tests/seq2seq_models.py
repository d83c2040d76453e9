"""Tiny random-weight encoder-decoder checkpoints of each BART-family architecture, made with transformers and saved
with save_pretrained (no real encoder-decoder model ships in a PyPI package: see README).

The weights are drawn so greedy decoding does not collapse into one repeated token (transformers' init, std
0.02, gives near-constant logits; a tied head over large embeddings repeats its input): embeddings sized to the
model's embedding scale, projections at unit gain, and, except for BART, an output head of its own.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

VOCAB = 64
FAMILIES = ("bart", "marian", "mbart", "m2m_100", "t5", "t5_v1_1")


def tiny_seq2seq_config(family: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  tie_word_embeddings=family == "bart")
    if family == "bart":
        return T.BartConfig(**common)
    if family == "marian":  # OPUS-MT's settings: SiLU, scaled embeddings, the pad token starts the decoder
        return T.MarianConfig(**common, pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1, eos_token_id=2,
                              activation_function="swish", scale_embedding=True)
    if family.startswith("t5"):  # v1.0: ReLU FFN, tied head scaled by d_model ** -0.5; v1.1: gated GELU
        v1_1 = family == "t5_v1_1"
        return T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=12, d_ff=64, num_layers=2, num_decoder_layers=2,
                          num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                          feed_forward_proj="gated-gelu" if v1_1 else "relu", tie_word_embeddings=not v1_1,
                          decoder_start_token_id=0, eos_token_id=2, n_positions=64)
    if family == "mbart":
        return T.MBartConfig(**common, decoder_start_token_id=2, scale_embedding=True)
    return T.M2M100Config(**common)  # ReLU, scaled embeddings, sinusoids from row pad + 1


@torch.no_grad()
def randomize_seq2seq_(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scale = math.sqrt(model.config.d_model) if getattr(model.config, "scale_embedding", False) else 1.0
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n == "final_logits_bias"]
    for name, p in tensors:
        if "embed_positions" in name and model.config.model_type == "marian":
            continue  # fixed sinusoids, not saved
        noise = torch.randn(p.shape, generator=g)
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "embed" in name or "shared" in name or "relative_attention_bias" in name:
            p.copy_(noise / scale)
        else:
            p.copy_(noise * (2.0 if ("q_proj" in name or "k_proj" in name) else 1.0) / math.sqrt(p.shape[1]))


def build_tiny_seq2seq(family: str, directory: Path, seed: int = 0):
    """Create, randomize and save a tiny checkpoint (+ a word-level tokenizer over 'w3 w4 ...') in `directory`;
    return the transformers model (eval, fp32)."""
    import transformers as T

    from parity.parity_utils import save_tiny_tokenizer

    torch.manual_seed(seed)
    model = T.AutoModelForSeq2SeqLM.from_config(tiny_seq2seq_config(family), dtype=torch.float32)
    randomize_seq2seq_(model, seed)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    save_tiny_tokenizer(directory, VOCAB)
    return model


def hf_generate(model, encoder_ids: list[int], max_new_tokens: int, **kwargs) -> torch.Tensor:
    """transformers' generate with none of the model's own generation defaults (forced tokens, minimum length,
    repeat bans): only what the arguments ask for."""
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, min_length=0,
                    forced_bos_token_id=None, forced_eos_token_id=None, no_repeat_ngram_size=0)
    settings.update(kwargs)
    return model.generate(torch.tensor([encoder_ids], device=model.device), **settings)
