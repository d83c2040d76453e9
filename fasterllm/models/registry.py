"""Hugging Face architecture names -> our model classes, and what each one runs with (`fasterllm models`)."""
from __future__ import annotations

from torch import nn

from fasterllm.config import (
    DECODER_ARCHITECTURES,
    ENCODER_DECODER_ARCHITECTURES,
    ENCODER_MODEL_TYPES,
    GEMMA_ARCHITECTURES,
    LATENT_ATTENTION_ARCHITECTURES,
    MOE_ARCHITECTURES,
    POOLING_MODES,
    QK_NORM_OVER_HEADS_ARCHITECTURES,
    QUANTIZATION_METHODS,
    STORED_METHODS,
    check_architecture,
)
from fasterllm.loader.gguf_families import GGUF_HF_ARCHITECTURES
from fasterllm.models.bart import BartForConditionalGeneration
from fasterllm.models.deepseek_v2 import DeepseekV2ForCausalLM
from fasterllm.models.llama import LlamaForCausalLM
from fasterllm.models.t5 import T5ForConditionalGeneration

_MODELS: dict[str, type[nn.Module]] = {name: LlamaForCausalLM for name in DECODER_ARCHITECTURES}
_MODELS["DeepseekV2ForCausalLM"] = DeepseekV2ForCausalLM
_MODELS.update({name: BartForConditionalGeneration for name in ENCODER_DECODER_ARCHITECTURES})
_MODELS["T5ForConditionalGeneration"] = T5ForConditionalGeneration


def model_class(architecture: str) -> type[nn.Module]:
    check_architecture(architecture)
    return _MODELS[architecture]


def supported_models() -> list[dict[str, str]]:
    """One row per architecture (and per encoder model_type) with what runs it and what it runs with."""
    gguf = GGUF_HF_ARCHITECTURES
    one_device = QK_NORM_OVER_HEADS_ARCHITECTURES + LATENT_ATTENTION_ARCHITECTURES
    generating = ", ".join(m for m in QUANTIZATION_METHODS if m not in STORED_METHODS) + " (fp8: Hopper GPUs)"
    # models/llama_cpu_decode.py's layers (where the layers' windows agree and no q/k/v is clipped), and
    # models/seq2seq_cpu_decode.py's (the BART family's)
    one_call = [name for name in DECODER_ARCHITECTURES
                if name not in MOE_ARCHITECTURES + GEMMA_ARCHITECTURES + LATENT_ATTENTION_ARCHITECTURES]
    one_call += [name for name in ENCODER_DECODER_ARCHITECTURES if _MODELS[name] is BartForConditionalGeneration]
    rows = []
    for name, cls in _MODELS.items():
        decoder_only, experts = name in DECODER_ARCHITECTURES, name in MOE_ARCHITECTURES
        rows.append({
            "architecture": name,
            "code": f"models/{cls.__module__.rsplit('.', 1)[-1]}.py" + (" + layers/moe.py" if experts else ""),
            "kind": "decoder, mixture of experts" if experts else "decoder" if decoder_only else "encoder-decoder",
            "gpu": "Triton kernels" + (" (fused MoE)" if experts else "") + ", CUDA graphs",
            "cpu_decode_step": "one C++ call" if name in one_call else "Python layers",
            "quantization": generating + (", gguf (Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 blocks)" if name in gguf else "")
            + (" (experts: int8 codes per channel, e4m3 under fp8, float under gguf)" if experts else ""),
            "gguf": "yes" if name in gguf else "no",
            "tensor_parallel": "yes" if decoder_only and name not in one_device else "no",
            "embeddings": "last-token pooling" if decoder_only else "no",
        })
    for model_type in ENCODER_MODEL_TYPES:
        rows.append({"architecture": f"model_type {model_type} (task='embed')", "code": "models/bert.py",
                     "kind": "encoder", "gpu": "Triton kernels, CUDA graphs", "cpu_decode_step": "no decoding",
                     "quantization": "none", "gguf": "no",
                     "tensor_parallel": "no", "embeddings": " / ".join(POOLING_MODES) + " pooling"})
    return rows
