"""Pre-quantized checkpoints run as stored: GPTQ (as GPTQModel and AutoGPTQ write it) and AWQ (AutoAWQ's GEMM
packing). Each quantized projection's packed 4-bit codes, fp16 scales and zero points become the int4 layer's codes,
scales and minimums (layers/quantization/int4.py) in the checkpoint's own groups where the layer holds that width
(32-256 inputs), with no rounding: a wider group, or a whole row (group_size -1), is several of the layer's with the
same scale, and weight = scale * (code - zero)
= code * scale + minimum with minimum = -zero * scale, exact in fp32. 8-bit GPTQ becomes, as exact: per output
channel and symmetric (group_size -1, every zero point 128), the int8 layer's codes (code - 128, as int8) and scales
(int8.py, whose CPU kernels include our C++ ones, where uint8_grouped's dequantizes on the fly); in groups (a
multiple of 32), or asymmetric per channel, the uint8_grouped layer's codes (0..255), scales and minimums in groups
of 32.

Storage, per projection (input width K, output width N, G groups of inputs), weight[n, k] from group g of input k:
  GPTQ  qweight int32 [K / 8, N]: input k = 8 i + j in bits 4 j .. 4 j + 3 of row i (8-bit: [K / 4, N], input
                4 i + j in bits 8 j .. 8 j + 7);
        qzeros  int32 [G, N / 8]: output n = 8 i + j in bits 4 j of column i (8-bit: [G, N / 4], output 4 i + j
                in bits 8 j), stored minus one in the "gptq" (v1) checkpoint format, as it is in "gptq_v2";
        scales  fp16 [G, N];  g_idx int32 [K]: each input's group. Act-order checkpoints (desc_act) quantized the
                inputs in another order, so their groups are scattered over the inputs: the loader sorts the inputs by
                group (a stable argsort, `order`), each group's inputs then contiguous, and yields the codes of the
                sorted inputs with <module>.qorder (int64 [K]: the stored input of each sorted one); the layer then
                multiplies x[..., order] (layers/quantization/stored.py). In group order, order is the identity.
  AWQ   qweight int32 [K, N / 8] and qzeros int32 [G, N / 8]: outputs packed 8 to a word, output 8 i + ORDER[j]
        in bits 4 j of column i (ORDER = 0 2 4 6 1 3 5 7); scales fp16 [G, N].
The other tensors (embeddings, norms, the output head) are stored float and load as they are.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fasterllm.config import PREQUANTIZED_METHODS
from fasterllm.layers.quantization.int4 import GROUP_SIZE as OUR_GROUP, held_group_size, repeat_groups
from fasterllm.loader.compressed_tensors import CompressedTensorsCheckpoint, unpack_nibbles
from fasterllm.loader.hf_checkpoint import iter_safetensors, read_json

SUPPORTED = ("GPTQ (4- or 8-bit, with or without desc_act) and AWQ (4-bit) checkpoints with group_size a multiple of 32 "
             "(GPTQ: or -1)")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble j of a word holds output 8 i + _AWQ_ORDER[j]
_BYTE_SHIFTS = torch.arange(0, 32, 8, dtype=torch.int32)
_INT8_ZERO = 128  # 8-bit GPTQ's symmetric zero point: code - 128 is the int8 value


def stored_quantization(model_dir: Path) -> StoredQuantization | None:
    """The checkpoint's quantization (config.json's quantization_config, or GPTQ's quantize_config.json); None for a
    float checkpoint (one whose compressed-tensors config quantizes only the KV cache too). One it does not run is a
    ValueError naming it."""
    raw = read_json(model_dir / "config.json").get("quantization_config")
    if raw is None and (model_dir / "quantize_config.json").is_file():
        raw = {"quant_method": "gptq", **read_json(model_dir / "quantize_config.json")}
    if raw is None:
        return None
    if raw.get("quant_method") == "compressed-tensors":
        return CompressedTensorsCheckpoint.of(raw, model_dir)
    return QuantizedCheckpoint.of(raw, model_dir)


@dataclass(frozen=True)
class QuantizedCheckpoint:
    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group per row
    zero_offset: int  # added to a stored zero point: 1 in GPTQ's v1 format
    bits: int = 4  # 4, or 8 (GPTQ)
    layout: str = "int4"  # the layer its projections become: int4; 8-bit: int8 (per channel, symmetric), else
    # uint8_grouped

    @property
    def name(self) -> str:
        return self.method.upper() if self.bits == 4 else f"{self.method.upper()} {self.bits}-bit"

    @property
    def input_order(self) -> bool:
        """Whether each projection comes with .qorder (GPTQ's g_idx may order its inputs by activation; the int8
        layer's per channel, one group, whose order is the stored one)."""
        return self.method == "gptq" and self.layout != "int8"

    @staticmethod
    def of(raw: dict, model_dir: Path) -> QuantizedCheckpoint:
        """A GPTQ or AWQ quantization_config's settings; one it does not run is a ValueError naming it."""
        method, bits, group_size = raw.get("quant_method"), raw.get("bits", raw.get("w_bit")), raw.get(
            "group_size", raw.get("q_group_size", -1))
        if method not in PREQUANTIZED_METHODS:
            raise ValueError(f"{model_dir} is quantized with quant_method={method!r}, which is not supported; "
                             f"supported: {SUPPORTED}; or quantize a float checkpoint at load with "
                             "quantization='int4' / 'int8'")
        whole_rows = group_size == -1 and method == "gptq"
        if bits not in ((4, 8) if method == "gptq" else (4,)) or not (
                whole_rows or (group_size > 0 and group_size % OUR_GROUP == 0)):
            raise ValueError(f"{model_dir} is a {method.upper()} checkpoint of bits={bits}, group_size={group_size}; "
                             f"supported: {SUPPORTED}")
        if method == "awq" and (raw.get("version", "gemm").lower() != "gemm" or raw.get("zero_point") is False):
            raise ValueError(f"{model_dir} is an AWQ checkpoint of version={raw.get('version')!r}, zero_point="
                             f"{raw.get('zero_point')!r}; supported: AutoAWQ's GEMM packing with zero points")
        # GPTQ desc_act (act-order) or not: each projection's g_idx says its inputs' groups (_gptq_input_order)
        zero_offset = 1 if method == "gptq" and raw.get("checkpoint_format", "gptq") == "gptq" else 0
        layout = "int4" if bits == 4 else "int8" if whole_rows and raw.get("sym") is not False else "uint8_grouped"
        return QuantizedCheckpoint(method, group_size, zero_offset, bits, layout)

    def weights(self, model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every weight: a quantized projection as three row-indexed tensors,
        <module>.qcodes uint8 [N, K], .qscales and .qmins fp32 [N, K / held group] (what layers/quantization/gguf.py's
        holders take), GPTQ's with .qorder int64 [K] (the stored input each of the K sorted ones is); for the int8
        layout as .qweight int8 [N, K] and .qscales fp32 [N] (layers/quantization/stored.py's code holders); the rest
        as stored."""
        packed: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in iter_safetensors(model_dir):
            module, _, leaf = name.rpartition(".")
            if leaf in ("qweight", "qzeros", "scales", "g_idx"):
                packed.setdefault(module, {})[leaf] = tensor
            else:
                yield name, tensor
        for module, parts in packed.items():
            missing = {"qweight", "qzeros", "scales"} - set(parts)
            if missing:
                raise ValueError(f"{self.method.upper()} projection {module!r} lacks {sorted(missing)}; the "
                                 "checkpoint is incomplete")
            if self.layout == "int8":
                codes, row_scales = self.unpack_int8(module, parts)
                yield f"{module}.qweight", codes
                yield f"{module}.qscales", row_scales
                continue
            codes, scales, minimums, order = self.unpack(module, parts)
            yield f"{module}.qcodes", codes
            yield f"{module}.qscales", scales
            yield f"{module}.qmins", minimums
            if self.input_order:
                yield f"{module}.qorder", order

    def held_group_size(self, inputs: int) -> int:
        """The group width a projection of this many inputs holds: the checkpoint's (at most 256, int4.py's
        held_group_size) for 4-bit codes, 32 for 8-bit ones (uint8_grouped's); a group that does not divide the
        inputs is a ValueError naming both."""
        held = held_group_size(self.group_size, inputs, self.name)
        return held if self.layout == "int4" else OUR_GROUP

    def unpack(self, module: str, parts: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One projection's packed tensors -> (codes uint8 [N, K], scales and minimums [N, K / held group]
        (held_group_size), order int64 [K]): column k of the codes is stored input order[k] (the identity but for
        GPTQ's act-order)."""
        qweight, scales = parts["qweight"], parts["scales"].float()
        gptq, per_word = self.method == "gptq", 32 // self.bits
        inputs, outputs = (qweight.shape[0] * per_word if gptq else qweight.shape[0]), scales.shape[1]
        group = inputs if self.group_size == -1 else self.group_size
        packed_shape = (inputs // per_word, outputs) if gptq else (inputs, outputs // per_word)
        if inputs % OUR_GROUP or inputs % group or scales.shape[0] != inputs // group or outputs % per_word or \
                qweight.shape != packed_shape or parts["qzeros"].shape != (inputs // group, outputs // per_word):
            raise ValueError(f"{self.method.upper()} projection {module!r}: qweight {tuple(parts['qweight'].shape)}, "
                             f"qzeros {tuple(parts['qzeros'].shape)} and scales {tuple(scales.shape)} do not fit "
                             f"group_size={self.group_size}; the checkpoint and its quantization_config disagree")
        if gptq:
            codes, zeros, order = _gptq_codes(module, parts, self.bits, group)
            codes = codes[order]
        else:
            codes, zeros, order = _awq_unpack(qweight), _awq_unpack(parts["qzeros"]), torch.arange(inputs)
        zeros = zeros.float() + self.zero_offset
        held = self.held_group_size(inputs)
        minimums = repeat_groups((-zeros * scales).t(), group, held)
        return codes.t().contiguous().to(torch.uint8), repeat_groups(scales.t(), group, held), minimums, order

    def unpack_int8(self, module: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """An 8-bit GPTQ projection per output channel -> (int8 codes [N, K], code - 128; fp32 scales [N])."""
        words, scales, zero_words = parts["qweight"], parts["scales"].float(), parts["qzeros"]
        inputs, outputs = words.shape[0] * 4, scales.shape[1]
        if scales.shape != (1, outputs) or words.shape != (inputs // 4, outputs) or outputs % 4 or \
                zero_words.shape != (1, outputs // 4):
            raise ValueError(f"GPTQ projection {module!r}: qweight {tuple(words.shape)}, qzeros "
                             f"{tuple(zero_words.shape)} and scales {tuple(scales.shape)} do not fit bits=8, "
                             "group_size=-1; the checkpoint and its quantization_config disagree")
        codes, zeros, _ = _gptq_codes(module, parts, 8, inputs)  # one group: g_idx all 0, the identity order
        zeros = zeros[0] + self.zero_offset
        if (zeros != _INT8_ZERO).any():
            found = sorted(set(zeros.tolist()))[:4]
            raise ValueError(f"GPTQ projection {module!r} has zero points {found} (after the checkpoint format's "
                             f"offset {self.zero_offset}), not {_INT8_ZERO} throughout, but its quantization_config "
                             "does not say sym=false, so it was to run as the int8 layer (symmetric codes); the "
                             "checkpoint and its config disagree: with sym=false it runs as uint8_grouped")
        return (codes - _INT8_ZERO).t().contiguous().to(torch.int8), scales[0].contiguous()


def _gptq_codes(module: str, parts: dict[str, torch.Tensor], bits: int, group: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GPTQ projection's packed words -> (codes [K, N] in stored order, zero points [K / group, N], input order
    [K] from g_idx: see _gptq_input_order); the caller checked the shapes."""
    unpack = unpack_nibbles if bits == 4 else _unpack_bytes
    words = parts["qweight"]  # [K / per_word, N]: the codes of a word are consecutive inputs
    inputs, outputs = words.shape[0] * (32 // bits), words.shape[1]
    codes = unpack(words).transpose(1, 2).reshape(inputs, outputs)
    zeros = unpack(parts["qzeros"]).reshape(inputs // group, outputs)
    return codes, zeros, _gptq_input_order(module, parts.get("g_idx"), inputs, group)


def _unpack_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [R, C, 4]: byte j of each word, from bits 8 j."""
    return (words[:, :, None] >> _BYTE_SHIFTS) & 0xFF


def _gptq_input_order(module: str, g_idx: torch.Tensor | None, inputs: int, group: int) -> torch.Tensor:
    """The stored inputs sorted by group (stable: the identity where g_idx is in group order, or absent), checked to
    make groups of `group` inputs each: sorted input p is then in group p // group."""
    if g_idx is None:
        return torch.arange(inputs)
    groups, g_idx = inputs // group, g_idx.long().reshape(-1)
    if g_idx.numel() != inputs or g_idx.min() < 0 or g_idx.max() >= groups or \
            (torch.bincount(g_idx, minlength=groups) != group).any():
        span = f"{int(g_idx.min())}..{int(g_idx.max())}" if g_idx.numel() else "none"
        raise ValueError(f"GPTQ projection {module!r}: g_idx ({g_idx.numel()} entries, groups {span}) does not put "
                         f"{group} of its {inputs} inputs in each of its {groups} groups; the checkpoint and its "
                         "quantization_config disagree")
    return torch.argsort(g_idx, stable=True)


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C / 8] -> [R, C]: nibble j of word i is column 8 i + _AWQ_ORDER[j]."""
    nibbles = unpack_nibbles(words)
    columns = torch.empty_like(nibbles)
    columns[:, :, list(_AWQ_ORDER)] = nibbles
    return columns.reshape(words.shape[0], -1)


StoredQuantization = QuantizedCheckpoint | CompressedTensorsCheckpoint  # what stored_quantization finds
