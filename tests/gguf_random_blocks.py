"""Random raw GGUF blocks of the types that run as stored: random bytes (codes, sub-block scales and mins) with valid
fp16 d fields, so that what they stand for is whatever gguf's own dequantize says, for the unpacking tests and for
small GGUF files whose projections are in k-quant types (the gguf package cannot quantize those)."""
import numpy as np

# bytes a block, weights a block, and the byte offsets of its fp16 fields (d, then m / dmin where there is one)
BLOCKS = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q8_0": (34, 32, (0,)),
          "Q4_K": (144, 256, (0, 2)), "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,))}
# about how many steps of d a weight spans (code range times a typical sub-scale), to give weights of a chosen size
_TYPICAL_STEPS = {"Q4_0": 8, "Q4_1": 8, "Q8_0": 64, "Q4_K": 8 * 32, "Q5_K": 16 * 32, "Q6_K": 32 * 64}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator,
                  magnitude: float | None = None) -> np.ndarray:
    """uint8 [rows, bytes a row] of random blocks. magnitude None: the fp16 fields are any finite fp16 (subnormals,
    negatives and the largest included); else about that size a weight (positive fields, for model tests)."""
    size, weights, fields = BLOCKS[type_name]
    blocks = rng.integers(0, 256, (rows, cols // weights, size), dtype=np.uint8)
    for offset in fields:
        if magnitude is None:
            bits = rng.integers(0, 1 << 16, blocks.shape[:2], dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # an inf or nan exponent -> a finite one
            values = bits.view(np.float16)
        else:
            values = (rng.uniform(0.5, 1.0, blocks.shape[:2]) * magnitude / _TYPICAL_STEPS[type_name]).astype(
                np.float16)
        blocks[..., offset:offset + 2] = values[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)
