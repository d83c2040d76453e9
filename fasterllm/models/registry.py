"""Hugging Face architecture names -> our model classes."""
from __future__ import annotations

from torch import nn

from fasterllm.config import (
    DECODER_ARCHITECTURES,
    ENCODER_DECODER_ARCHITECTURES,
    check_architecture,
)
from fasterllm.models.bart import BartForConditionalGeneration
from fasterllm.models.llama import LlamaForCausalLM
from fasterllm.models.t5 import T5ForConditionalGeneration

_MODELS: dict[str, type[nn.Module]] = {name: LlamaForCausalLM for name in DECODER_ARCHITECTURES}
_MODELS.update({name: BartForConditionalGeneration for name in ENCODER_DECODER_ARCHITECTURES})
_MODELS["T5ForConditionalGeneration"] = T5ForConditionalGeneration


def model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture)
    return _MODELS[architecture]
