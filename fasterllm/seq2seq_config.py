"""The configs of encoder-decoder models (models/bart.py, models/t5.py), read from a Hugging Face config.json. Each
exposes what the engine reads of any model config: architecture, vocab_size, max_position_embeddings (the decoder's
context), eos_token_ids, sliding_window (None), is_encoder_decoder (True), and the encoder's own limit and the
decoder's start tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fasterllm.config import ENCODER_DECODER_ARCHITECTURES

# Hugging Face activation_function / T5's feed_forward_proj activation -> ours (models/bart.py, models/t5.py)
SEQ2SEQ_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "swish": "silu", "silu": "silu", "gelu_new": "gelu_tanh"}


@dataclass
class T5Config:
    """The shape of a T5 (T5 v1.0, v1.1 / Flan-T5, mT5 shapes): pre-norm RMS-style norms without biases, no position
    embeddings but a learned bias per head and relative-distance bucket added to attention scores (computed by the
    first layer of each stack, shared by its other layers), unscaled attention scores, an FFN that may be gated."""

    architecture: str
    vocab_size: int
    hidden_size: int
    head_dim: int  # d_kv: need not be hidden_size / heads
    num_heads: int
    ffn_dim: int
    encoder_layers: int
    decoder_layers: int
    activation: str  # one of SEQ2SEQ_ACTIVATIONS' values
    gated_ffn: bool
    num_buckets: int
    max_distance: int
    layer_norm_eps: float
    scale_decoder_outputs: bool  # tied-head T5 v1.0 scales the last hidden state by d_model ** -0.5
    max_position_embeddings: int  # no position table: the length the model was trained for (n_positions)
    decoder_start_token_id: int
    eos_token_ids: list[int] = field(default_factory=list)
    forced_bos_token_id: int | None = None
    is_encoder_decoder = True
    sliding_window = None
    model_type = "t5"

    @property
    def max_encoder_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, raw: dict[str, Any], eos: int | list[int] | None, forced_bos_token_id: int | None) -> T5Config:
        gated, _, act = raw.get("feed_forward_proj", "relu").rpartition("-")
        act = "gelu_new" if (gated, act) == ("gated", "gelu") else act  # transformers reads gated-gelu as gelu_new
        if gated not in ("", "gated") or act not in SEQ2SEQ_ACTIVATIONS:
            raise ValueError(f"feed_forward_proj={raw.get('feed_forward_proj')!r} is not supported; use ACT or "
                             f"gated-ACT with ACT one of {', '.join(SEQ2SEQ_ACTIVATIONS)}")
        start = raw.get("decoder_start_token_id")
        tied = raw.get("tie_word_embeddings", True) is not False
        return cls(raw["architectures"][0], raw["vocab_size"], raw["d_model"], raw["d_kv"], raw["num_heads"],
                   raw["d_ff"], raw["num_layers"], raw.get("num_decoder_layers") or raw["num_layers"],
                   SEQ2SEQ_ACTIVATIONS[act], gated == "gated", raw.get("relative_attention_num_buckets", 32),
                   raw.get("relative_attention_max_distance", 128), raw.get("layer_norm_epsilon", 1e-6),
                   raw.get("scale_decoder_outputs", tied), raw.get("n_positions", 512),
                   raw.get("pad_token_id", 0) if start is None else start,  # T5 starts the decoder with its pad token
                   [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), forced_bos_token_id)


@dataclass
class Seq2SeqConfig:
    """The shape of a BART-family encoder-decoder (BART, mBART, Marian, M2M100 / NLLB), in Hugging Face's terms.

    The families differ in where LayerNorm sits (after each residual add: BART, Marian; before each block with a
    final norm per stack: mBART, M2M100), in positions (learned rows from row 2: BART, mBART; fixed sinusoids:
    Marian from row 0, M2M100 from row pad + 1), in a LayerNorm over the embeddings (BART, mBART) and in a bias
    added to the logits (all but M2M100)."""

    architecture: str
    model_type: str
    vocab_size: int  # the decoder's (the output head's) vocabulary
    hidden_size: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    activation: str  # one of SEQ2SEQ_ACTIVATIONS' values
    max_position_embeddings: int  # of each stack: the longest encoder input and decoder sequence
    scale_embedding: bool
    decoder_start_token_id: int
    pad_token_id: int
    eos_token_ids: list[int] = field(default_factory=list)
    forced_bos_token_id: int | None = None  # the first generated token, where the model's config forces one
    encoder_vocab_size: int | None = None  # the encoder's own token table's rows; None: it reads the decoder's
    tie_word_embeddings: bool = True
    is_encoder_decoder = True
    sliding_window = None

    @property
    def pre_norm(self) -> bool:
        return self.model_type in ("mbart", "m2m_100")

    @property
    def layernorm_embedding(self) -> bool:
        return self.model_type in ("bart", "mbart")

    @property
    def final_logits_bias(self) -> bool:
        return self.model_type != "m2m_100"

    @property
    def embed_scale(self) -> float:
        return self.hidden_size ** 0.5 if self.scale_embedding else 1.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.decoder_attention_heads

    @property
    def max_encoder_len(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, raw: dict[str, Any], eos: int | list[int] | None,
                forced_bos_token_id: int | None) -> Seq2SeqConfig:
        architecture = raw["architectures"][0]
        act = raw.get("activation_function", "gelu")
        if act not in SEQ2SEQ_ACTIVATIONS:
            raise ValueError(f"activation_function={act!r} is not supported; use one of {', '.join(SEQ2SEQ_ACTIVATIONS)}")
        hidden = raw["d_model"]
        for side in ("encoder", "decoder"):
            if hidden % raw[f"{side}_attention_heads"]:
                raise ValueError(f"d_model={hidden} is not a multiple of {side}_attention_heads="
                                 f"{raw[f'{side}_attention_heads']}: the checkpoint's config is inconsistent")
        vocab = raw["vocab_size"]
        decoder_vocab = raw.get("decoder_vocab_size") or vocab
        # untied checkpoints (and Marian's with two vocabularies) give the encoder a token table of its own
        separate = raw.get("share_encoder_decoder_embeddings", True) is False or not raw.get("tie_word_embeddings", True)
        start = raw.get("decoder_start_token_id")
        if start is None:
            raise ValueError(f"{architecture}'s config.json names no decoder_start_token_id; the decoder cannot "
                             "start (add it to config.json or generation_config.json)")
        return cls(architecture, ENCODER_DECODER_ARCHITECTURES[architecture], decoder_vocab, hidden,
                   raw["encoder_layers"], raw["decoder_layers"], raw["encoder_attention_heads"],
                   raw["decoder_attention_heads"], raw["encoder_ffn_dim"], raw["decoder_ffn_dim"],
                   SEQ2SEQ_ACTIVATIONS[act], raw.get("max_position_embeddings", 1024),
                   bool(raw.get("scale_embedding", False)), start, raw.get("pad_token_id", 1),
                   [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), forced_bos_token_id,
                   vocab if separate else None, raw.get("tie_word_embeddings", True))
