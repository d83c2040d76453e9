"""One validated configuration: the model's shape, the KV cache, the scheduler and the device."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fasterllm.cpu_features import bf16_path_note, cpu_features
from fasterllm.layers.kv_cache_dtype import FP8_KV_DTYPE

logger = logging.getLogger("fasterllm")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# what quantization= takes (gguf: a GGUF's blocks as they are); layers/quantization/ implements each
QUANTIZATION_METHODS = ("int8", "int4", "w8a8", "fp8", "gguf", "gptq", "awq", "compressed-tensors")
# a checkpoint's own codes, named by its quantization_config, run as stored (loader/prequantized.py)
PREQUANTIZED_METHODS = ("gptq", "awq", "compressed-tensors")
STORED_METHODS = ("gguf", *PREQUANTIZED_METHODS)  # a file's own codes, never quantized at load


def check_method_name(method: str | None) -> None:
    """A ValueError naming the supported methods if method is none of them (None: no quantization)."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; supported: "
                         f"{', '.join(repr(m) for m in QUANTIZATION_METHODS)} or None (no quantization)")


@dataclass(frozen=True)
class LatentAttentionShape:
    """DeepSeek-V2's multi-head latent attention: queries from q_proj, or through a rank-q_lora_rank bottleneck when
    q_lora_rank is set; keys and values expanded per head from one kv_lora_rank latent per token, besides one
    qk_rope_head_dim key part per token that every head shares and that alone is rotated."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass
class ModelConfig:
    """The shape of a LLaMA-family decoder, in Hugging Face's terms."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen3)
    qk_norm_over_heads: bool = False  # OLMoE: that RMSNorm over all query heads together, and over all key heads
    clip_qkv: float | None = None  # OLMoE: queries, keys and values clamped to [-clip_qkv, clip_qkv]
    sliding_window: int | None = None  # attend to at most this many most recent tokens
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # llama3-style per-frequency divisors stored as a tensor in some GGUF files
    rope_freq_factors: torch.Tensor | None = None
    # Gemma 2: GELU (tanh) gates, norms of the (1 + weight) form, embeddings scaled by sqrt(hidden), a norm after
    # attention and one after the FFN besides the two before ("sandwich"), queries scaled by query_pre_attn_scalar,
    # attention scores and final logits soft-capped (cap * tanh(x / cap)), and a sliding window on some layers only
    hidden_act: str = "silu"
    norm_plus_one: bool = False
    embedding_multiplier: float | None = None
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_sliding_windows: list[int | None] | None = None  # per layer; None: every layer has sliding_window
    # Gemma 3: each layer's RoPE (base, scaling), local and global layers differing; None: every layer's is
    # (rope_theta, rope_scaling)
    layer_rope: list[tuple[float, dict[str, Any] | None]] | None = None
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): num_experts gated FFNs of moe_intermediate_size, top
    # num_experts_per_tok per token, their weights renormalized when norm_topk_prob; a shared expert of
    # shared_expert_intermediate_size (0: none); expert_layers[i]: layer i has experts (else the dense FFN)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    expert_layers: list[bool] | None = None
    # DeepSeek-V2: the chosen experts' weights times routed_scaling_factor; expert_groups (groups, groups kept):
    # experts chosen only within each token's best groups (group_limited_greedy); a shared expert without a gate
    routed_scaling_factor: float = 1.0
    expert_groups: tuple[int, int] | None = None
    shared_expert_gated: bool = True
    # DeepSeek-V2's multi-head latent attention (head_dim is then a query's and a key's width, qk_nope + qk_rope)
    latent_attention: LatentAttentionShape | None = None

    is_encoder_decoder = False

    def layer_rope_of(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(RoPE base, scaling) of layer `layer`."""
        return (self.rope_theta, self.rope_scaling) if self.layer_rope is None else self.layer_rope[layer]

    @property
    def rotary_dim(self) -> int:
        """How many of each query's and key's dimensions RoPE rotates."""
        return self.head_dim if self.latent_attention is None else self.latent_attention.qk_rope_head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to the whole sequence)."""
        return self.sliding_window if self.layer_sliding_windows is None else self.layer_sliding_windows[layer]

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}: the checkpoint's config is inconsistent")


# the Hugging Face decoder architectures models/registry.py runs (through models/llama.py, DeepSeek-V2 through
# models/deepseek_v2.py)
DECODER_ARCHITECTURES = ("DeepseekV2ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM",
                         "MistralForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Phi3ForCausalLM",
                         "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE_ARCHITECTURES = ("DeepseekV2ForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM",
                     "Qwen3MoeForCausalLM")
# multi-head latent attention (ModelConfig.latent_attention): one device only, no tensor parallelism yet
LATENT_ATTENTION_ARCHITECTURES = ("DeepseekV2ForCausalLM",)
# one RMSNorm over all query heads at once (and one over all key heads): their heads cannot split over ranks
QK_NORM_OVER_HEADS_ARCHITECTURES = ("OlmoeForCausalLM",)
# Gemma's layers: norms before and after each sublayer, GELU, soft-capping, windows alternating by layer
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# the GELU forms of a gated FFN (hidden_act / hidden_activation), besides "silu"
GATED_GELU_FORMS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


# the Hugging Face encoder-decoder architectures (models/bart.py, models/t5.py) -> their family's model_type
ENCODER_DECODER_ARCHITECTURES = {"BartForConditionalGeneration": "bart", "MBartForConditionalGeneration": "mbart",
                                 "MarianMTModel": "marian", "M2M100ForConditionalGeneration": "m2m_100",
                                 "T5ForConditionalGeneration": "t5"}


def check_architecture(architecture: str) -> None:
    if architecture not in DECODER_ARCHITECTURES and architecture not in ENCODER_DECODER_ARCHITECTURES:
        raise ValueError(f"Model architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(DECODER_ARCHITECTURES))} (decoder-only), "
                         f"{', '.join(sorted(ENCODER_DECODER_ARCHITECTURES))} (encoder-decoder)")


# Hugging Face hidden_act -> (F.gelu approximate=, oneDNN gelu algorithm)
GELU_FORMS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}

# the encoders task='embed' runs (model_type) -> whether position 0 is a later row (RoBERTa counts from
# padding_idx + 1)
ENCODER_MODEL_TYPES = {"bert": False, "roberta": True, "xlm-roberta": True}


@dataclass
class BertConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int  # row of position_embeddings that holds position 0

    @property
    def max_seq_len(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> BertConfig:
        model_type = raw.get("model_type", "bert")
        if model_type not in ENCODER_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a supported encoder; supported: "
                             f"{', '.join(ENCODER_MODEL_TYPES)}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type={raw['position_embedding_type']!r} is not supported; "
                             "only 'absolute' position embeddings are")
        hidden_act = raw.get("hidden_act", "gelu")
        if hidden_act not in GELU_FORMS:
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; use one of {', '.join(GELU_FORMS)}")
        offset = raw.get("pad_token_id", 1) + 1 if ENCODER_MODEL_TYPES[model_type] else 0
        return cls(model_type, raw["vocab_size"], raw["hidden_size"], raw["intermediate_size"],
                   raw["num_hidden_layers"], raw["num_attention_heads"], raw.get("max_position_embeddings", 512),
                   raw.get("type_vocab_size", 2), raw.get("layer_norm_eps", 1e-12), hidden_act, offset)


POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "last")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "cls"
    normalize: bool = True  # L2-normalise the pooled vector (sentence-transformers' Normalize module)

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not supported; use one of {', '.join(POOLING_MODES)}")


@dataclass
class EngineArgs:
    """Everything a user can set on `LLM(...)`, the CLI and the server."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    # KV cache budget: a fraction of GPU memory, or a number of GiB on the CPU
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 2.0
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False  # True: no CUDA graphs (decode steps, encoder batches: launched from Python)
    # launch the next decode step before reading this one's tokens, so host work overlaps the GPU's;
    # None: on where it pays (CUDA), off on the CPU (its forward pass is synchronous anyway)
    async_scheduling: bool | None = None
    # "dummy": random weights of the checkpoint's shape (config.json alone is enough): for benchmarks
    load_format: str = "auto"
    quantization: str | None = None  # one of QUANTIZATION_METHODS (layers/quantization/), None: float weights
    # "auto": the KV cache in the model's dtype (fp8 where the checkpoint carries KV-cache scales); "fp8" (or
    # "fp8_e4m3"): e4m3 with a per-tensor scale per layer (the checkpoint's, else 1.0), half the bytes of bf16 per token
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap": copy a preempted request's KV to a CPU pool
    swap_space_gib: float = 4.0  # size of that CPU pool
    watermark: float = 0.01
    long_prefill_token_threshold: int = 0
    # a step that carries decodes gives prompt chunks at most this many tokens: each decode waits for the whole step,
    # so this bounds the time between a stream's tokens while prompts arrive (0: max_num_batched_tokens alone)
    max_prefill_tokens_beside_decodes: int = 0
    task: str = "generate"  # or "embed": an encoder (BERT family) that returns one vector per input
    # shard the model over this many devices (one process each; the GPUs of one machine, or CPU processes)
    tensor_parallel_size: int = 1
    # where the ranks run: "uni" (in process, one rank), "mp" (a process per rank on this machine), "ray" (a Ray
    # actor per rank across the nodes of a Ray cluster); None: uni for one rank, mp for more
    distributed_executor_backend: str | None = None
    # GPUs with symmetric memory: a decode step's all-reduces fused with the RMSNorm after them (one launch, no
    # NCCL); True keeps NCCL for every all-reduce
    disable_custom_all_reduce: bool = False
    # serving: this many engine processes (replicas), each with its own copy of the model on tensor_parallel_size
    # GPUs of its own, behind one server that balances requests by load
    data_parallel_size: int = 1

    def validate(self) -> None:
        check_method_name(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.quantization == "gguf" and self.load_format == "dummy":
            raise ValueError("quantization='gguf' runs a GGUF file's own blocks, which load_format='dummy' does not "
                             "read; use quantization='int4' for random weights")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} must be 'auto' (read the checkpoint) or 'dummy' "
                             "(random weights of its shape)")
        if self.task not in ("generate", "embed"):
            raise ValueError(f"task={self.task!r} is not supported; use 'generate' or 'embed'")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} must be >= 1")
        if self.task == "embed" and self.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: task='embed' runs its encoder on one "
                             "device; use tensor_parallel_size=1")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} must be 'uni' (in "
                             "process), 'mp' (one process per rank), 'ray' (Ray actors, across nodes) or None (uni "
                             "for one rank, mp for more)")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank in process, but tensor_parallel_size="
                             f"{self.tensor_parallel_size}; use 'mp' or leave it unset")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size} is not supported; use one of 8, 16, 32, 64, 128")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib={self.cpu_kv_cache_gib} must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be 'recompute' or 'swap'")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib={self.swap_space_gib} must be >= 0")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark} must be in [0, 1)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0 "
                             "(0 = no cap)")
        if self.max_prefill_tokens_beside_decodes < 0:
            raise ValueError(f"max_prefill_tokens_beside_decodes={self.max_prefill_tokens_beside_decodes} must be >= 0 "
                             "(0 = no cap)")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} was asked for but this torch build sees no CUDA GPU; "
                             "use device='cpu'")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not supported; use 'cpu', 'cuda' or 'auto'")
        return device

    def resolve_cache_dtype(self, dtype: torch.dtype, checkpoint_has_kv_scales: bool = False) -> torch.dtype:
        """The KV cache's element type for a model run in dtype. A checkpoint with KV-cache scales (compressed-tensors'
        kv_cache_scheme) was calibrated for an fp8 cache: "auto" runs one with its scales, as vLLM does."""
        if self.kv_cache_dtype == "auto" and checkpoint_has_kv_scales:
            logger.info("%s carries fp8 KV-cache scales (a kv_cache_scheme): kv_cache_dtype='auto' runs an fp8 KV "
                        "cache with them, as vLLM does; remove kv_cache_scheme from its config.json for a cache in the "
                        "model's dtype", self.model)
            return FP8_KV_DTYPE
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or dtype

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            if device.type == "cuda":
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            # bf16 halves the bytes a CPU decode step reads; only worth it with native bf16 math
            return torch.bfloat16 if cpu_features().native_bf16 else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16'")
        dtype = _DTYPES[self.dtype]
        note = bf16_path_note(dtype) if device.type == "cpu" else None
        if note:
            logger.warning(note)
        return dtype


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "recompute"
    watermark: float = 0.0  # fraction of blocks new admissions leave free for running requests
    long_prefill_token_threshold: int = 0  # most prompt tokens one request may take per step; 0 = no cap
    max_prefill_tokens_beside_decodes: int = 0  # most prompt tokens of a step that carries decodes; 0 = no cap


# kv_cache_dtype's names: None keeps the model's dtype
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8_KV_DTYPE, "fp8_e4m3": FP8_KV_DTYPE}

# what an attention layer keeps in the paged KV cache
KV_CACHE_KINDS = ("full", "sliding_window", "cross", "none")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer caches per token: "full" (causal self-attention over the whole sequence),
    "sliding_window" (the last sliding_window tokens), "cross" (the encoder's keys and values, written once) or
    "none". Layers with equal specs form one cache group: they share a request's block table."""

    kind: str
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KV_CACHE_KINDS:
            raise ValueError(f"KV cache kind {self.kind!r} is not one of {', '.join(KV_CACHE_KINDS)}")
        if (self.kind == "sliding_window") != (self.sliding_window is not None):
            raise ValueError(f"a {self.kind!r} KV cache takes sliding_window={self.sliding_window} only with the kind "
                             "'sliding_window'")

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Key and value of one token in this layer."""
        if self.kind == "none":
            return 0
        return 2 * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


@dataclass
class CacheConfig:
    block_size: int
    num_blocks: int = 0

