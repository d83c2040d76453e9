"""The KV-cache scales a checkpoint carries: one K and one V scale per attention layer, calibrated for an fp8 (e4m3)
KV cache that holds K / k_scale and V / v_scale and reads back stored * scale (layers/kv_cache_dtype.py).

Read from compressed-tensors checkpoints (what llm-compressor writes): config.json's quantization_config (quant_method
"compressed-tensors") declares a kv_cache_scheme (8-bit float, strategy "tensor", static, symmetric), and each
layer's scales are the tensors model.layers.N.self_attn.k_scale and .v_scale (a scalar or [1]); llm-compressor's
older checkpoints name them self_attn.k_proj.output_scale and self_attn.v_proj.output_scale. A self_attn.q_scale
(attention quantization) is passed over: queries stay in the model's dtype here. Every tensor-parallel rank reads
every layer's scales whole (a scale covers all of a layer's KV heads).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from fasterllm.config import ModelConfig
from fasterllm.loader.hf_checkpoint import iter_safetensors, read_json
from fasterllm.loader.weight_parts import WeightSource, read_whole
from fasterllm.seq2seq_config import Seq2SeqConfig, T5Config

# model.layers.N.self_attn.{k,v,q}_scale, or the older model.layers.N.self_attn.{k,v}_proj.output_scale
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:([kvq])_scale|([kv])_proj\.output_scale)$")
SUPPORTED = ("a kv_cache_scheme of 8-bit floats (type 'float', num_bits 8), strategy 'tensor' (one K and one V scale "
             "per layer), static (dynamic false) and symmetric")
# per-head scales (llm-compressor's strategy "attn_head", which vLLM runs on its FlashAttention backend only) are not
# taken: the kernels fold one K scale into the score scale and one V scale into the output
_PER_HEAD_FIX = ("fasterllm's fp8 KV cache takes one K and one V scale per layer (kv_cache_scheme strategy 'tensor', "
                 "a scalar or [1] each; strategy 'attn_head', one per KV head, is not supported): re-export the "
                 "checkpoint with llm-compressor's kv_cache_scheme strategy 'tensor'")


def without_kv_cache_scales(weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
    """A weight stream without its KV-cache (and query) scales: they go to the attention layers, not to parameters."""
    return ((name, tensor) for name, tensor in weights if _SCALE_NAME.search(name) is None)


def kv_cache_scales_of(model_dir: Path, config: ModelConfig | Seq2SeqConfig | T5Config
                       ) -> list[tuple[float, float]] | None:
    """(k_scale, v_scale) of each layer of a decoder-only checkpoint that declares a kv_cache_scheme; None where it
    declares none."""
    if not declares_kv_cache_scales(model_dir):
        return None
    if config.is_encoder_decoder:
        raise ValueError(f"{model_dir} declares a kv_cache_scheme, but KV-cache scales are read for decoder-only "
                         f"models, not {config.architecture}; remove kv_cache_scheme from its config.json")
    return read_kv_cache_scales(model_dir, config.num_hidden_layers)


def declares_kv_cache_scales(model_dir: Path) -> bool:
    """Whether config.json's quantization_config declares a kv_cache_scheme; one this engine cannot run is a
    ValueError naming it."""
    quantization = read_json(model_dir / "config.json").get("quantization_config") or {}
    scheme = quantization.get("kv_cache_scheme")
    if scheme is None:
        return False
    if quantization.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{model_dir} declares a kv_cache_scheme under quant_method "
                         f"{quantization.get('quant_method')!r}; KV-cache scales are read from compressed-tensors "
                         "checkpoints only (quant_method 'compressed-tensors')")
    if scheme.get("strategy") == "attn_head":
        raise ValueError(f"{model_dir}'s kv_cache_scheme has strategy 'attn_head'; {_PER_HEAD_FIX}")
    kind = (scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy"), bool(scheme.get("dynamic")),
            scheme.get("symmetric", True))
    if kind != ("float", 8, "tensor", False, True):
        raise ValueError(f"{model_dir}'s kv_cache_scheme {scheme} is not supported; supported: {SUPPORTED}")
    return True


def read_kv_cache_scales(model_dir: Path, num_layers: int) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of each of num_layers attention layers, read from the checkpoint's safetensors files.
    A missing, misshapen, non-positive or doubly stored scale is a ValueError naming the tensor."""
    found: dict[tuple[int, str], tuple[str, float]] = {}
    for name, source in iter_safetensors(model_dir, lazy=True):  # only the scales are read
        match = _SCALE_NAME.search(name)
        if match is None or match.group(2) == "q":
            continue
        layer, kind = int(match.group(1)), match.group(2) or match.group(3)
        if (layer, kind) in found:
            raise ValueError(f"checkpoint tensors {found[layer, kind][0]!r} and {name!r} are both layer {layer}'s "
                             f"{kind}_scale; keep one (self_attn.{kind}_scale)")
        found[layer, kind] = name, _scale_value(name, read_whole(source))
    missing = [f"{kind}_scale of layer {layer}" for layer in range(num_layers) for kind in "kv"
               if (layer, kind) not in found]
    if missing:
        raise ValueError(f"{model_dir} declares a kv_cache_scheme but lacks {len(missing)} of its "
                         f"{2 * num_layers} scales ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); "
                         "the checkpoint is incomplete: export it again, or remove kv_cache_scheme from its "
                         "config.json to run without KV-cache scales")
    extra = sorted({layer for layer, _ in found} - set(range(num_layers)))
    if extra:
        raise ValueError(f"{model_dir} has KV-cache scales for layer {extra[0]}, but the model has {num_layers} "
                         "layers; the checkpoint and its config disagree")
    return [(found[layer, "k"][1], found[layer, "v"][1]) for layer in range(num_layers)]


def _scale_value(name: str, tensor: torch.Tensor) -> float:
    """One scale as a float: a positive finite scalar or [1] tensor."""
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; {_PER_HEAD_FIX}")
    value = float(tensor.float())
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"checkpoint tensor {name!r} = {value}, but a KV-cache scale must be a positive finite "
                         "number (the cache holds value / scale); the calibration that wrote it failed: calibrate "
                         "the checkpoint again")
    return value
