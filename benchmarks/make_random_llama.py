"""Write a Llama-3-8B-shaped (or SmolLM2-135M-, Qwen3-8B-, Gemma-2-9B-, Qwen3-30B-A3B-, Mixtral-8x7B-,
DeepSeek-V2-Lite-shaped) model directory with random bf16 weights, for GPU benchmarks (no hub needed).

    python benchmarks/make_random_llama.py /tmp/llama3-8b-random            # the 8B shape, about 16 GB
    python benchmarks/make_random_llama.py /tmp/llama3-8b-2l --num-layers 2  # the same shape, 2 layers (a quick check)
    python benchmarks/make_random_llama.py /tmp/llama3-8b --config-only       # for `--load-format dummy`
    python benchmarks/make_random_llama.py /tmp/smollm2 --shape smollm2-135m --config-only  # SmolLM2-135M's shape
    python benchmarks/make_random_llama.py /tmp/llama-tiny --shape llama-tiny  # host-bound on a CPU
    python benchmarks/make_random_llama.py /tmp/qwen3-moe --shape qwen3-30b-a3b --config-only  # 128 experts, top 8
    python benchmarks/make_random_llama.py /tmp/mixtral --shape mixtral-8x7b --config-only  # 8 experts, top 2 (H200)
    python benchmarks/make_random_llama.py /tmp/dsv2-lite --shape deepseek-v2-lite --config-only  # latent attention
    python benchmarks/make_random_llama.py /tmp/l8-gptq --config-only --gptq-group 128  # 4-bit GPTQ, groups of 128

The tokenizer is word-level ("w0 w1 ..." over the shape's whole vocabulary) with a minimal
chat template: `fasterllm bench serve` sends token ids, so only decoding speed matters. Needs
transformers (the test extra). Weights are drawn on the GPU when there is one (minutes on a CPU).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def llama3_8b_config(num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
                       bos_token_id=128000, eos_token_id=128001)


def smollm2_135m_config(num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2)


def llama_tiny_config(num_layers: int):
    """Hidden 64 over a 1000-word vocabulary: GEMMs are negligible, so a CPU run times the host's work per step."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2)


def qwen3_8b_config(num_layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=num_layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)


def gemma2_9b_config(num_layers: int):
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=num_layers,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        max_position_embeddings=8192, bos_token_id=2, eos_token_id=1)


def qwen3_30b_a3b_config(num_layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=num_layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                          tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)


def mixtral_8x7b_config(num_layers: int):
    """Mixtral-8x7B-v0.1's config.json: 8 experts of 14,336 x 4,096, top 2; 46.7 B parameters, 93 GB in bf16 (an
    H200 holds them)."""
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def deepseek_v2_lite_config(num_layers: int):
    """DeepSeek-V2-Lite's config.json: latent attention (kv_lora_rank 512, queries without a low-rank bottleneck),
    YaRN over a 4096-token original context, 64 routed experts (top 6) and 2 shared ones, layer 0 dense."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                            num_hidden_layers=num_layers, num_attention_heads=16, num_key_value_heads=16,
                            q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                            first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False,
                            routed_scaling_factor=1.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                             "mscale": 0.707, "mscale_all_dim": 0.707,
                                             "original_max_position_embeddings": 4096, "beta_fast": 32,
                                             "beta_slow": 1},
                            tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001)


SHAPES = {"llama3-8b": (llama3_8b_config, 32), "smollm2-135m": (smollm2_135m_config, 30),
          "llama-tiny": (llama_tiny_config, 2),
          "qwen3-8b": (qwen3_8b_config, 36), "gemma2-9b": (gemma2_9b_config, 42),
          "qwen3-30b-a3b": (qwen3_30b_a3b_config, 48), "mixtral-8x7b": (mixtral_8x7b_config, 32),
          "deepseek-v2-lite": (deepseek_v2_lite_config, 27)}


def save_word_tokenizer(directory: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab[f"w{vocab_size}"] = vocab_size  # the unknown-word token, past the model's vocabulary
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=f"w{vocab_size}"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=f"w{bos_id}", eos_token=f"w{eos_id}",
                                   unk_token=f"w{vocab_size}")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--num-layers", type=int, default=None, help="default: the shape's (32 for Llama-3-8B)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-only", action="store_true",
                        help="config.json and tokenizer only: for --load-format dummy (random weights at load)")
    parser.add_argument("--gptq-group", type=int, default=None, metavar="G",
                        help="with --config-only: the config of a 4-bit symmetric GPTQ checkpoint in groups of G "
                             "inputs (-1: whole rows), whose random codes --load-format dummy runs as stored")
    ns = parser.parse_args()
    from transformers import AutoModelForCausalLM

    make_config, default_layers = SHAPES[ns.shape]
    config = make_config(ns.num_layers or default_layers)
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    if ns.gptq_group is not None:
        if not ns.config_only:
            parser.error("--gptq-group writes a configuration only: add --config-only")
        if any(getattr(config, name, 0) for name in ("num_experts", "num_local_experts", "n_routed_experts")):
            parser.error(f"--gptq-group: {ns.shape}'s experts do not run from stored codes yet; bench it with "
                         "--quantization int4 on a float config instead")
        config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": ns.gptq_group, "sym": True,
                                      "desc_act": False, "checkpoint_format": "gptq"}
    if ns.config_only:
        config.save_pretrained(ns.directory)
        save_word_tokenizer(ns.directory, config.vocab_size, config.bos_token_id, config.eos_token_id)
        return
    torch.manual_seed(ns.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: no fp32 copy of 8B weights
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)  # initialised N(0, 0.02), as transformers does
    model.save_pretrained(ns.directory, safe_serialization=True, max_shard_size="5GB")
    save_word_tokenizer(ns.directory, config.vocab_size, config.bos_token_id, config.eos_token_id)
    print(f"wrote {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters to {ns.directory}")


if __name__ == "__main__":
    main()
