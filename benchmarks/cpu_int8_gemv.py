"""Is the CPU int8 decode matmul bound by memory or by the core? torch._weight_int8pack_mm over one decode
step's SmolLM2-135M weights (30 layers of qkv / o / gate_up / down and the 49152-row head: 134 MB, more than the
caches hold, so every step reads them from DRAM), at 1 and 2 torch threads, next to a plain bf16 read of
a 128 MB tensor (torch.sum) as the DRAM reference. Random int8 weights; speeds do not depend on values.

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


def main() -> None:
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * 30 + [HEAD_SHAPE]
    weights = [(torch.randint(-127, 128, shape, dtype=torch.int8), torch.rand(shape[0], dtype=torch.bfloat16))
               for shape in shapes]
    rows = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in {shape[1] for shape in shapes}}
    total = sum(w.numel() for w, _ in weights)
    dram = torch.randn(64 << 20, dtype=torch.bfloat16)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        step = seconds(lambda: [torch._weight_int8pack_mm(rows[w.shape[1]], w, s) for w, s in weights])
        read = seconds(lambda: dram.sum())
        print(f"{threads} thread(s): _weight_int8pack_mm step {step * 1e3:.2f} ms = {total / step / 1e9:.1f} GB/s of "
              f"{total / 1e6:.0f} MB; bf16 torch.sum {dram.numel() * 2 / read / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
