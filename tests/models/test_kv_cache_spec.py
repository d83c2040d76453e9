"""Each attention layer declares what it caches; the KV cache is sized and laid out from those declarations."""
import pytest
import torch

from fasterllm.config import KVCacheSpec, ModelConfig
from fasterllm.models.llama import LlamaForCausalLM


def tiny(sliding_window=None) -> LlamaForCausalLM:
    config = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         sliding_window=sliding_window)
    return LlamaForCausalLM(config, 64, torch.device("cpu"), torch.float32)


def test_every_layer_declares_its_cache():
    assert tiny().kv_cache_specs() == [KVCacheSpec("full", 2, 16)] * 3
    assert tiny(sliding_window=8).kv_cache_specs() == [KVCacheSpec("sliding_window", 2, 16, 8)] * 3


def test_a_spec_knows_its_bytes_and_refuses_nonsense():
    assert KVCacheSpec("full", 2, 16).bytes_per_token(torch.bfloat16) == 2 * 2 * 16 * 2
    assert KVCacheSpec("none", 2, 16).bytes_per_token(torch.float32) == 0
    with pytest.raises(ValueError, match="'ring' is not one of full, sliding_window, cross, none"):
        KVCacheSpec("ring", 2, 16)
    with pytest.raises(ValueError, match="sliding_window=8 only with the kind 'sliding_window'"):
        KVCacheSpec("full", 2, 16, 8)
