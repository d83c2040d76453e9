"""compressed-tensors checkpoints (what llm-compressor writes and vLLM users deploy) run as stored: each quantized
projection's codes and scales go into our layers unchanged, no rounding anywhere.

Schemes run (config.json's quantization_config, quant_method "compressed-tensors", one config group over the
Linear layers, the output head ignored), with the layer each becomes:
  W8A8   format int-quantized: int8 weights per output channel, int8 activations dynamic per token -> w8a8's layer
  W8A16  format int-quantized: int8 weights per output channel, float activations            -> int8's layer
  FP8    format float-quantized: e4m3 weights per channel or per tensor, e4m3 activations dynamic per token
         -> fp8's layer (Hopper GPUs)
  W4A16  format pack-quantized: 4-bit weights in groups of a multiple of 32 inputs (or per channel), symmetric or
         with zero points, float activations -> the int4 layer (as GPTQ's codes: loader/prequantized.py)
Storage, per projection (inputs K, outputs N, G groups): weight int8 or e4m3 [N, K] and weight_scale [N, 1] (per
tensor: [1]); or weight_packed int32 [N, K / 8] (input 8 i + j in bits 4 j of word i, each code stored plus 8),
weight_scale [N, G], weight_zero_point int32 [N / 8, G] (packed the same way along the outputs; symmetric: none) and
weight_shape. weight = scale * (code - zero point).
A kv_cache_scheme (with one of these schemes, or alone over float weights) carries the fp8 KV cache's scales:
loader/kv_cache_scales.py reads them.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fasterllm.layers.quantization.int4 import GROUP_SIZE as OUR_GROUP, held_group_size, repeat_groups
from fasterllm.loader.hf_checkpoint import iter_safetensors

SUPPORTED = ("compressed-tensors checkpoints of one scheme over the Linear layers with the output head ignored: W8A8 "
             "(int8 per channel, dynamic per-token int8 activations), W8A16 (int8 per channel), FP8 (e4m3 per channel "
             "or per tensor, dynamic per-token activations) or W4A16 (4-bit in groups of a multiple of 32, or per "
             "channel), each with or without a kv_cache_scheme; or a kv_cache_scheme alone over float weights")
# the layer each scheme's projections become (layers/quantization: STORED_LINEARS)
LAYOUTS = {"W8A8": "w8a8", "W8A16": "int8", "FP8": "fp8", "W4A16": "int4"}
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [R, C, 8]: nibble j of each word, from bits 4 j."""
    return (words[:, :, None] >> _SHIFTS) & 0xF


@dataclass(frozen=True)
class CompressedTensorsCheckpoint:
    scheme: str  # a key of LAYOUTS
    group_size: int  # W4A16: inputs per scale; 0: one per output channel
    method = "compressed-tensors"
    input_order = False  # its projections' inputs in stored order (act-order is refused)

    @property
    def layout(self) -> str:
        return LAYOUTS[self.scheme]

    @property
    def name(self) -> str:
        return f"compressed-tensors {self.scheme}"

    @staticmethod
    def of(raw: dict, model_dir: Path) -> CompressedTensorsCheckpoint | None:
        """The scheme of a quantization_config with quant_method "compressed-tensors"; None where it quantizes
        nothing but the KV cache (float weights, loader/kv_cache_scales.py reads its scales). One this engine does
        not run is a ValueError naming what it found."""
        groups = list((raw.get("config_groups") or {}).values())
        ignored = [name for name in raw.get("ignore") or [] if name != "lm_head"]

        def refuse(what: str) -> ValueError:
            return ValueError(f"{model_dir} is a compressed-tensors checkpoint with {what}, which is not supported; "
                              f"supported: {SUPPORTED}")

        if raw.get("sparsity_config") or raw.get("transform_config"):
            raise refuse("sparsity or transform settings")
        if not groups and raw.get("kv_cache_scheme"):
            return None
        if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
            raise refuse(f"{len(groups)} config groups targeting {[g.get('targets') for g in groups]}")
        if ignored or "lm_head" not in (raw.get("ignore") or []):
            raise refuse(f"ignore={raw.get('ignore')}")
        weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        dynamic_tokens = inputs is not None and inputs.get("dynamic") is True and inputs.get("strategy") == "token"
        described = (f"weights {weights.get('type')}{weights.get('num_bits')} {weights.get('strategy')} "
                     f"(group_size {weights.get('group_size')}, symmetric {weights.get('symmetric')}, actorder "
                     f"{weights.get('actorder')}), input activations {inputs}")
        if weights.get("actorder") or weights.get("dynamic"):
            raise refuse(described)
        if kind == ("int", 8, "channel") and weights.get("symmetric"):
            if inputs is None:
                return CompressedTensorsCheckpoint("W8A16", 0)
            if dynamic_tokens and inputs.get("type") == "int" and inputs.get("num_bits") == 8:
                return CompressedTensorsCheckpoint("W8A8", 0)
        elif kind[:2] == ("float", 8) and kind[2] in ("channel", "tensor") and weights.get("symmetric"):
            if dynamic_tokens and inputs.get("type") == "float" and inputs.get("num_bits") == 8:
                return CompressedTensorsCheckpoint("FP8", 0)
        elif kind[:2] == ("int", 4) and inputs is None:
            group = weights.get("group_size") or 0
            if kind[2] == "channel" or (kind[2] == "group" and group > 0 and group % OUR_GROUP == 0):
                return CompressedTensorsCheckpoint("W4A16", group if kind[2] == "group" else 0)
        raise refuse(described)

    def weights(self, model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every weight. A quantized projection comes as the holder's tensors
        (layers/quantization/stored.py): <module>.qweight (int8 or e4m3 [N, K]) and .qscales (fp32 [N]); or, for
        W4A16, <module>.qcodes (uint8 [N, K]), .qscales and .qmins (fp32 [N, K / held group]). The rest as stored."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in iter_safetensors(model_dir):
            module, _, leaf = name.rpartition(".")
            if leaf in ("weight_scale", "weight_packed", "weight_zero_point", "weight_shape", "input_scale") or (
                    leaf == "weight" and tensor.dtype in (torch.int8, torch.float8_e4m3fn)):
                parts.setdefault(module, {})[leaf] = tensor
            else:
                yield name, tensor
        for module, stored in parts.items():
            if "weight_scale" not in stored or ("weight" in stored) == ("weight_packed" in stored):
                raise ValueError(f"compressed-tensors projection {module!r} holds {sorted(stored)}; the checkpoint "
                                 f"is incomplete or not {self.scheme}")
            if self.layout == "int4":
                for leaf, tensor in zip(("qcodes", "qscales", "qmins"), self.unpack_int4(module, stored)):
                    yield f"{module}.{leaf}", tensor
            else:
                codes, scales = stored["weight"], stored["weight_scale"].float().reshape(-1)
                yield f"{module}.qweight", codes
                yield f"{module}.qscales", scales.expand(codes.shape[0]).contiguous()  # a tensor's scale, per row

    def held_group_size(self, inputs: int) -> int:
        """The group width a W4A16 projection of this many inputs holds (int4.py's held_group_size); a group that
        does not divide the inputs is a ValueError naming both."""
        return held_group_size(self.group_size, inputs, self.name)

    def unpack_int4(self, module: str, stored: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W4A16 -> (codes uint8 [N, K] in 0..15, scales and minimums fp32 [N, K / held group]
        (held_group_size)): code - 8 is the signed value, so weight = scale * (code - 8 - zero) = code * scale +
        minimum with minimum = -(8 + zero) * scale."""
        words, scales = stored["weight_packed"], stored["weight_scale"].float()
        outputs, inputs = (int(d) for d in stored["weight_shape"])
        group = self.group_size or inputs
        if words.shape != (outputs, inputs // 8) or inputs % group or inputs % OUR_GROUP or \
                scales.shape != (outputs, inputs // group):
            raise ValueError(f"compressed-tensors projection {module!r}: weight_packed {tuple(words.shape)} and "
                             f"weight_scale {tuple(scales.shape)} do not fit weight_shape {[outputs, inputs]} in "
                             f"groups of {group}; the checkpoint and its quantization_config disagree")
        codes = unpack_nibbles(words).reshape(outputs, inputs)
        zeros = torch.zeros_like(scales)
        if "weight_zero_point" in stored:  # packed along the outputs, stored plus 8 as the codes are
            packed = stored["weight_zero_point"]
            zeros = unpack_nibbles(packed.t().contiguous()).reshape(scales.shape[1], -1)[:, :outputs].t() - 8.0
        held = self.held_group_size(inputs)
        return codes.to(torch.uint8), repeat_groups(scales, group, held), repeat_groups(-(8.0 + zeros) * scales, group,
                                                                                       held)
