"""Is the CPU int8 decode matmul bound by memory or by the core? torch's int8 kernels over one decode step's
SmolLM2-135M weights (30 layers of qkv / o / gate_up / down and the 49152-row head: 134 MB, more than the caches
hold, so every step reads them from DRAM), at 1 and 2 torch threads, next to a plain bf16 read of a 128 MB tensor
(torch.sum) as the DRAM reference. Random int8 weights; speeds do not depend on values. The kernels:
  _weight_int8pack_mm        weight-only int8, bf16 activations (what quantization="int8" runs)
  _int_mm                    int8 x int8 -> int32 over the [N, K] weight's transposed view, the row quantized per
                             token first (what quantization="w8a8" runs where the sums are exact)
  quantized.linear_dynamic   FBGEMM (x86 engine): fp32 in and out, the row quantized to int8 inside (VNNI)
  onednn.qlinear_pointwise   oneDNN int8 x int8 (VNNI/AMX where present); the row quantized per tensor first, by
                             torch ops counted in the time

    python3 benchmarks/cpu_int8_gemv.py
"""
from __future__ import annotations

import time

import torch

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2: qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)


def seconds(fn, repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def int_mm_step(weights, rows):
    """W8A8Linear's CPU product: the row quantized per token, torch._int_mm, scaled back."""
    from fasterllm.layers.quantization.w8a8 import quantize_per_token

    scales = [s.float()[None, :] for _, s in weights]

    def linear(x, w, w_scales):
        codes, x_scales = quantize_per_token(x)
        return torch._int_mm(codes, w.t()) * x_scales * w_scales

    return lambda: [linear(rows[w.shape[1]], w, s) for (w, _), s in zip(weights, scales)]


def fbgemm_step(weights, rows):
    """quantized.linear_dynamic over prepacked per-channel int8 weights (the x86 engine: FBGEMM)."""
    torch.backends.quantized.engine = "x86"
    packed = [torch.ops.quantized.linear_prepack(
        torch._make_per_channel_quantized_tensor(w, s.double(), torch.zeros(w.shape[0], dtype=torch.long), 0), None)
        for w, s in weights]
    fp32_rows = {k: row.float() for k, row in rows.items()}
    shapes = [w.shape[1] for w, _ in weights]
    return lambda: [torch.ops.quantized.linear_dynamic(fp32_rows[k], p, False) for k, p in zip(shapes, packed)]


def onednn_step(weights, rows):
    """onednn.qlinear_pointwise over prepacked int8 weights, each row quantized per tensor (symmetric) first."""
    packed = [(torch.ops.onednn.qlinear_prepack(w, [1, w.shape[1]]), s.float(),
               torch.zeros(w.shape[0], dtype=torch.int32)) for w, s in weights]
    fp32_rows = {k: row.float() for k, row in rows.items()}

    def linear(x, packed_weight, scales, zeros):
        x_scale = x.abs().amax().item() / 127
        x_codes = torch.round(x / x_scale).clamp_(-127, 127).to(torch.int8)
        return torch.ops.onednn.qlinear_pointwise(x_codes, x_scale, 0, packed_weight, scales, zeros, None, 1.0, 0,
                                                  torch.float32, "none", [], "")

    shapes = [w.shape[1] for w, _ in weights]
    return lambda: [linear(fp32_rows[k], *p) for k, p in zip(shapes, packed)]


def main() -> None:
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * 30 + [HEAD_SHAPE]
    weights = [(torch.randint(-127, 128, shape, dtype=torch.int8), torch.rand(shape[0], dtype=torch.bfloat16))
               for shape in shapes]
    rows = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {shape[1] for shape in shapes}}
    total = sum(w.numel() for w, _ in weights)
    dram = torch.randn(64 << 20, dtype=torch.bfloat16)
    kernels = {"_weight_int8pack_mm": lambda: [torch._weight_int8pack_mm(rows[w.shape[1]], w, s) for w, s in weights],
               "_int_mm": int_mm_step(weights, rows), "quantized.linear_dynamic": fbgemm_step(weights, rows), "onednn.qlinear_pointwise": onednn_step(weights, rows)}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        read = seconds(lambda: dram.sum())
        print(f"{threads} thread(s): bf16 torch.sum {dram.numel() * 2 / read / 1e9:.1f} GB/s; one step's "
              f"{total / 1e6:.0f} MB of int8 weights:")
        for name, step in kernels.items():
            took = seconds(step)
            print(f"  {name:26s} {took * 1e3:6.2f} ms = {total / took / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
