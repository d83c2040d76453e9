"""GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) unpacked into 4-bit codes and a scale and minimum per 32 weights, without
rounding anything: a weight is codes * scale + minimum exactly as llama.cpp dequantizes it.

Q4_0 / Q4_1: a block holds 32 weights of one row: fp16 d (Q4_1: then fp16 m), then 16 bytes whose low nibbles
are weights 0..15 and high nibbles weights 16..31. Q4_0 is (code - 8) * d, i.e. minimum = -8 d.
Q4_K (the 4-bit part of the Q4_K_S / Q4_K_M files llama.cpp users download): a super-block of 256 weights,
144 bytes: fp16 d and dmin, 12 bytes of eight 6-bit scales sc and mins m (sub-blocks 0-3: the low 6 bits of bytes
0-3 and 4-7; sub-blocks 4-7: the nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 and 4-7 above them), then
128 bytes in four runs of 32: run r's low nibbles are sub-block 2 r, its high nibbles sub-block 2 r + 1. Weight =
d * sc * code - dmin * m, so scale = d * sc and minimum = -dmin * m (both exact in fp32: an fp16 times a 6-bit
integer).
"""
from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_SUPER_BLOCK, _Q4_K_BYTES = 256, 144


def unpack_q4_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw bytes of a [rows, cols] Q4_0 / Q4_1 / Q4_K tensor -> (uint8 codes [rows, cols] in 0..15,
    fp32 scales [rows, cols/32], fp32 minimums [rows, cols/32])."""
    if type_name not in Q4_TYPES:
        raise ValueError(f"unpack_q4_blocks reads {', '.join(Q4_TYPES)}, not {type_name}")
    if type_name == "Q4_K":
        return _unpack_q4_k(raw, shape)
    rows, cols = shape
    header = 4 if type_name == "Q4_1" else 2
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // BLOCK, header + BLOCK // 2)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        minimums = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        minimums = -8 * scales  # exact: a power-of-two multiple
    nibbles = blocks[..., header:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(minimums)


def _unpack_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // _SUPER_BLOCK, _Q4_K_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, super-blocks, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[..., 4:16].astype(np.int32)
    sc = np.concatenate([packed[..., 0:4] & 63, (packed[..., 8:12] & 0xF) | ((packed[..., 0:4] >> 6) << 4)], axis=-1)
    m = np.concatenate([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], axis=-1)
    runs = blocks[..., 16:].reshape(rows, cols // _SUPER_BLOCK, 4, BLOCK)
    codes = np.stack([runs & 0x0F, runs >> 4], axis=3).reshape(rows, cols)
    scales = (d * sc).reshape(rows, cols // BLOCK)
    minimums = (-dmin * m).reshape(rows, cols // BLOCK)
    return torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(minimums)


def dequantize_q4_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> torch.Tensor:
    """The fp32 [rows, cols] weight of Q4_0 / Q4_1 / Q4_K blocks, codes * scale + minimum: the values gguf's own
    dequantize gives, bit for bit (tests/layers/quantization/test_gguf_blocks.py), in one torch expression instead of
    its per-row-group numpy loop (0.1 s against 0.4 s for SmolLM2's 210 Q4 tensors)."""
    codes, scales, minimums = unpack_q4_blocks(raw, type_name, shape)
    rows, cols = shape
    return (codes.view(rows, cols // BLOCK, BLOCK).float() * scales[..., None] + minimums[..., None]).view(rows, cols)
