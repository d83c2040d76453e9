"""GPTQ checkpoints (as GPTQModel and AutoGPTQ write them), run as stored: each quantized projection's packed 4-bit
codes, fp16 scales and zero points become the int4 layer's codes, scales and minimums (layers/quantization/int4.py,
groups of 32 inputs), with no rounding. A GPTQ group of 64 or 128 inputs, or a whole row (group_size -1), is
several of ours with the same scale and minimum.

Storage, per projection (input width K, output width N, G groups):
  qweight int32 [K / 8, N]: the code of input k = 8 i + j in bits 4 j .. 4 j + 3 of row i;
  qzeros  int32 [G, N / 8]: the zero point of output n = 8 i + j in bits 4 j of column i, stored minus one in
                            the "gptq" (v1) checkpoint format, as it is in "gptq_v2";
  scales  fp16  [G, N];  g_idx int32 [K]: the group of each input.
  weight[n, k] = scales[g, n] * (code[k, n] - zero[g, n]) with g = g_idx[k]: as int4 codes, minimum -zero * scale.
The other tensors (embeddings, norms, the output head) are stored float and load as they are.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fasterllm.loader.hf_checkpoint import iter_safetensors, read_json

OUR_GROUP = 32  # the int4 layer's group of inputs
_PACKED = ("qweight", "qzeros", "scales", "g_idx")
SUPPORTED = "4-bit codes, group_size a multiple of 32 or -1, desc_act false (or a g_idx in group order)"


@dataclass(frozen=True)
class GPTQConfig:
    group_size: int  # -1: one group per row
    zero_offset: int  # added to a stored zero point: 1 in the v1 format

    @staticmethod
    def of(model_dir: Path) -> GPTQConfig | None:
        """The checkpoint's GPTQ settings (config.json's quantization_config, or quantize_config.json); None for an
        unquantized checkpoint. A quantization it does not run is a ValueError naming it."""
        raw = read_json(model_dir / "config.json").get("quantization_config")
        if raw is None and (model_dir / "quantize_config.json").is_file():
            raw = {"quant_method": "gptq", **read_json(model_dir / "quantize_config.json")}
        if raw is None:
            return None
        method = raw.get("quant_method")
        if method != "gptq":
            raise ValueError(f"{model_dir} is quantized with quant_method={method!r}, which is not supported; "
                             f"pre-quantized checkpoints load from GPTQ ({SUPPORTED}), or quantize a float "
                             "checkpoint at load with quantization='int4' / 'int8'")
        bits, group_size = raw.get("bits"), raw.get("group_size", -1)
        if bits != 4 or not (group_size == -1 or (group_size > 0 and group_size % OUR_GROUP == 0)):
            raise ValueError(f"{model_dir} is a GPTQ checkpoint of bits={bits}, group_size={group_size}; supported: "
                             f"{SUPPORTED}")
        # desc_act: its g_idx may still be in group order; unpack_gptq checks each projection's
        zero_offset = 0 if raw.get("checkpoint_format", "gptq") == "gptq_v2" else 1
        return GPTQConfig(group_size, zero_offset)


def iter_gptq_weights(model_dir: Path, config: GPTQConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every weight: a quantized projection as three row-indexed tensors,
    <module>.qcodes uint8 [N, K], .qscales and .qmins fp32 [N, K / 32] (what layers/quantization/gguf.py's holder
    takes), the rest as stored."""
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_safetensors(model_dir):
        module, _, leaf = name.rpartition(".")
        if leaf in _PACKED:
            packed.setdefault(module, {})[leaf] = tensor
        else:
            yield name, tensor
    for module, parts in packed.items():
        missing = {"qweight", "qzeros", "scales"} - set(parts)
        if missing:
            raise ValueError(f"GPTQ projection {module!r} lacks {sorted(missing)}; the checkpoint is incomplete")
        codes, scales, minimums = unpack_gptq(module, parts, config)
        yield f"{module}.qcodes", codes
        yield f"{module}.qscales", scales
        yield f"{module}.qmins", minimums


def unpack_gptq(module: str, parts: dict[str, torch.Tensor],
                config: GPTQConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One projection's packed tensors -> (codes uint8 [N, K], scales [N, K / 32], minimums [N, K / 32]), codes *
    scale + minimum being the stored weight."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    inputs, outputs = qweight.shape[0] * 8, qweight.shape[1]
    group = inputs if config.group_size == -1 else config.group_size
    if inputs % OUR_GROUP or inputs % group or scales.shape != (inputs // group, outputs) or qzeros.shape != (inputs // group, outputs // 8):
        raise ValueError(f"GPTQ projection {module!r}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} "
                         f"and scales {tuple(scales.shape)} do not fit group_size={config.group_size}; the checkpoint "
                         "and its quantization_config disagree")
    g_idx = parts.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(inputs) // group):
        raise ValueError(f"GPTQ projection {module!r} orders its inputs by activation (desc_act, a g_idx out of group "
                         f"order), which is not supported; supported: {SUPPORTED}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(inputs, outputs)  # row 8 i + j
    zeros = ((qzeros[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(inputs // group, outputs)
    zeros = (zeros + config.zero_offset).float()
    per_ours = group // OUR_GROUP
    our_scales = scales.t().repeat_interleave(per_ours, dim=1).contiguous()
    minimums = (-zeros * scales).t().repeat_interleave(per_ours, dim=1).contiguous()
    return codes.t().contiguous().to(torch.uint8), our_scales, minimums
