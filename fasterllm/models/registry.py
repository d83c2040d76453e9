"""Hugging Face architecture names -> our model classes."""
from __future__ import annotations

from torch import nn

from fasterllm.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"Model architecture {architecture!r} is not supported; supported: {', '.join(sorted(_MODELS))}")
    return _MODELS[architecture]
