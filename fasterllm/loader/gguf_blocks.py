"""GGUF blocks that run as stored (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0) unpacked into one code per weight and a
scale and minimum per group of consecutive weights of a row, without rounding anything: a weight is
codes * scale + minimum, in fp32, exactly as llama.cpp (and gguf's own dequantize) computes it.

Q4_0 / Q4_1: a block holds 32 weights of one row: fp16 d (Q4_1: then fp16 m), then 16 bytes whose low nibbles
are weights 0..15 and high nibbles weights 16..31. Q4_0 is (code - 8) * d, i.e. minimum = -8 d.
Q8_0: fp16 d, then 32 int8 q: weight q * d; stored as code q + 128 (0..255) with minimum = -128 d.
Q4_K (the 4-bit part of the Q4_K_S / Q4_K_M files llama.cpp users download): a super-block of 256 weights,
144 bytes: fp16 d and dmin, 12 bytes of eight 6-bit scales sc and mins m (sub-blocks 0-3: the low 6 bits of bytes
0-3 and 4-7; sub-blocks 4-7: the nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 and 4-7 above them), then
128 bytes in four runs of 32: run r's low nibbles are sub-block 2 r, its high nibbles sub-block 2 r + 1. Weight =
d * sc * code - dmin * m, so scale = d * sc and minimum = -dmin * m (both exact in fp32: an fp16 times a 6-bit
integer).
Q5_K: Q4_K's super-block with 32 bytes qh between the scales and the nibbles (176 bytes): bit s of qh[l] is the
fifth bit (16) of weight l of sub-block s. Codes 0..31, scale and minimum as Q4_K's.
Q6_K (the attn_v / ffn_down of a Q4_K_M file): a super-block of 256 weights, 210 bytes: 128 bytes ql, 64 bytes qh,
16 int8 scales sc, fp16 d last. Each half of 128 weights reads 64 bytes of ql and 32 of qh: weight 32 r + l of the
half (r = 0..3, l = 0..31) is the low (r < 2) or high nibble of ql[l + 32 (r % 2)] with bits 2r, 2r+1 of qh[l]
above it, a 6-bit code q; weight = d * sc * (q - 32), sc the scale of its 16 weights. So groups of 16: scale =
d * sc and minimum = -32 scale (exact: fp16 d times an 8-bit integer, times 6-bit codes, fits fp32's 24 bits).

Every type's groups are 32 weights but Q6_K's 16; unpack_blocks repeats a 32-group's scale and minimum over two
16-groups where a projection that also holds Q6_K parts asks for 16 (exact: the same values).
"""
from __future__ import annotations

import numpy as np
import torch

from fasterllm.layers.quantization.gguf import BlockLayout

BLOCK = 32
# the types each layout holds without rounding: 4-bit codes (int4), or up to 8-bit codes (uint8_grouped)
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
NATIVE_GROUP_SIZES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q5_K": 32, "Q8_0": 32, "Q6_K": 16}
_SUPER_BLOCK = 256
_K_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def block_layout(type_names: tuple[str, ...]) -> BlockLayout | None:
    """The layout of a projection whose parts have these GGUF types (one fused projection runs one layout; a mix of
    Q4_K and Q6_K parts, Q4_K_M's attention, runs as 8-bit codes in groups of 16); None if a type has none."""
    if not all(name in NATIVE_GROUP_SIZES for name in type_names):
        return None
    if all(name in Q4_TYPES for name in type_names):
        return BlockLayout("int4", BLOCK)
    return BlockLayout("uint8_grouped", min(NATIVE_GROUP_SIZES[name] for name in type_names))


def unpack_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int], group_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw bytes of a [rows, cols] tensor of a type of NATIVE_GROUP_SIZES -> (uint8 codes [rows, cols], fp32 scales
    and minimums [rows, cols / group_size]); group_size: the type's own (None) or a divisor of it."""
    if type_name not in NATIVE_GROUP_SIZES:
        raise ValueError(f"GGUF type {type_name} has no unpacker here (supported: {', '.join(NATIVE_GROUP_SIZES)}); "
                         "it is dequantized to float instead")
    rows, cols = shape
    if type_name in _K_BYTES:
        blocks = np.ascontiguousarray(raw).reshape(rows, cols // _SUPER_BLOCK, _K_BYTES[type_name])
        codes, scales, minimums = _UNPACK_K[type_name](blocks)
    else:
        codes, scales, minimums = _unpack_32(np.ascontiguousarray(raw), type_name, rows, cols)
    codes = codes.reshape(rows, cols)
    scales, minimums = (t.reshape(rows, -1).astype(np.float32) for t in (scales, minimums))
    own = NATIVE_GROUP_SIZES[type_name]
    if group_size not in (None, own):
        if own % group_size:
            raise ValueError(f"{type_name}'s groups of {own} cannot be regrouped in {group_size}")
        scales, minimums = (np.repeat(t, own // group_size, axis=1) for t in (scales, minimums))
    return torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(minimums)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte start of every block, as fp32 [..., 1]."""
    return blocks[..., start:start + 2].copy().view(np.float16).astype(np.float32)


def _unpack_32(raw: np.ndarray, type_name: str, rows: int, cols: int) -> tuple[np.ndarray, ...]:
    """Q4_0, Q4_1, Q8_0: blocks of 32 weights with their own fp16 header."""
    header = 4 if type_name == "Q4_1" else 2
    payload = BLOCK if type_name == "Q8_0" else BLOCK // 2
    blocks = raw.reshape(rows, cols // BLOCK, header + payload)
    scales = _fp16(blocks, 0)
    if type_name == "Q8_0":  # int8 q -> q + 128
        return blocks[..., header:] ^ np.uint8(0x80), scales, -128 * scales  # exact: a power-of-two multiple
    minimums = _fp16(blocks, 2) if type_name == "Q4_1" else -8 * scales
    nibbles = blocks[..., header:]
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1), scales, minimums


def _k_scales_and_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the eight 6-bit scales and mins of each super-block (bytes 4..15) as [..., 8] int32."""
    packed = blocks[..., 4:16].astype(np.int32)
    sc = np.concatenate([packed[..., 0:4] & 63, (packed[..., 8:12] & 0xF) | ((packed[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, m


def _unpack_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    sc, m = _k_scales_and_mins(blocks)
    runs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, BLOCK)
    codes = np.stack([runs & 0x0F, runs >> 4], axis=3)  # (run, nibble) = sub-block 2 run + nibble
    return codes, _fp16(blocks, 0) * sc, -_fp16(blocks, 2) * m


def _unpack_q5_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    codes, scales, minimums = _unpack_q4_k(np.concatenate([blocks[..., :16], blocks[..., 48:]], axis=-1))
    qh = blocks[..., 16:48]  # [rows, super-blocks, 32]: bit s is sub-block s's
    fifth = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8 sub-blocks, 32]
    return codes.reshape(fifth.shape) | (fifth << 4), scales, minimums


def _unpack_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    lead = blocks.shape[:2]
    ql = blocks[..., :128].reshape(*lead, 2, 2, BLOCK)  # (half, r % 2, l)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, BLOCK)  # (half, l)
    low = np.stack([ql & 0x0F, ql >> 4], axis=3).reshape(*lead, 2, 4, BLOCK)  # (half, r = 2 nibble + r % 2, l)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # (half, r, l)
    scales = _fp16(blocks, 208) * blocks[..., 192:208].view(np.int8)  # [..., 16]
    return low | (high << 4), scales, -32 * scales


_UNPACK_K = {"Q4_K": _unpack_q4_k, "Q5_K": _unpack_q5_k, "Q6_K": _unpack_q6_k}


def dequantize_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> torch.Tensor:
    """The fp32 [rows, cols] weight of blocks of a type of NATIVE_GROUP_SIZES, codes * scale + minimum: the values
    gguf's own dequantize gives, bit for bit (tests/layers/quantization/test_gguf_blocks.py), in one torch expression
    instead of its per-row-group numpy loop (0.1 s against 0.4 s for SmolLM2's 210 Q4 tensors)."""
    codes, scales, minimums = unpack_blocks(raw, type_name, shape)
    rows, cols = shape
    group = NATIVE_GROUP_SIZES[type_name]
    return (codes.view(rows, cols // group, group).float() * scales[..., None] + minimums[..., None]).view(rows, cols)
