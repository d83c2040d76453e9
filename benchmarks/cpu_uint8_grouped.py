"""What running a GGUF's Q8_0 / Q5_K / Q6_K projections as stored costs on the CPU: the uint8_grouped layer's torch
path (layers/quantization/uint8_grouped.py: blocks of output rows dequantized on the fly, then F.linear) and our C++
kernel (kernels/native/cpu_gemv.py, each ISA this CPU runs, where a compiler built it) against F.linear over the same
weight held in fp32 (what a float load of the file runs) and against torch's int8 kernel over the weight re-rounded
to int8 (what quantization='gguf' ran for these types before). Random codes; speeds do not depend on values.
Medians of repeated calls, fp32 activations, torch's threads as set.

    python3 benchmarks/cpu_uint8_grouped.py [--rows 1 8 64 512]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fasterllm.kernels.native import cpu_extension, cpu_gemv
from fasterllm.layers.quantization.int8 import Int8WeightOnlyLinear
from fasterllm.layers.quantization.uint8_grouped import Uint8GroupedLinear, dequantize_uint8_grouped

SHAPES = {"SmolLM2 gate_up [3072, 576]": (3072, 576), "SmolLM2 down [576, 1536]": (576, 1536),
          "7B-like [4096, 4096]": (4096, 4096), "7B-like down [4096, 11008]": (4096, 11008)}


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    isas = cpu_extension.supported_isas() if cpu_extension.load() else []
    print(f"| shape | group | rows | torch path ms | {' | '.join(f'C++ {isa} ms' for isa in isas)} | fp32 F.linear ms "
          "| torch path / F.linear | int8 (torch) ms |")
    print("| --- " * (7 + len(isas)) + "|")
    for label, (n, k) in SHAPES.items():
        for group in (16, 32):
            torch.manual_seed(0)
            codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
            scales, minimums = torch.rand(n, k // group) * 1e-3, torch.randn(n, k // group) * 1e-2
            layer = Uint8GroupedLinear(codes, scales, minimums, None, native=False)
            packed = cpu_gemv.pack_uint8_grouped(codes, scales, minimums) if isas else None
            weight = dequantize_uint8_grouped(codes, scales, minimums)
            int8 = Int8WeightOnlyLinear.from_float(weight, None) if group == 32 else None
            for rows in args.rows:
                x = torch.randn(rows, k)
                ours = median_ms(lambda: layer(x), args.repeats)
                native = [median_ms(lambda: cpu_gemv.uint8_grouped_gemv(x, packed, isa), args.repeats) for isa in isas]
                dense = median_ms(lambda: F.linear(x, weight), args.repeats)
                requantized = f"{median_ms(lambda: int8(x), args.repeats):.2f}" if int8 is not None else ""
                print(f"| {label} | {group} | {rows} | {ours:.2f} | {' | '.join(f'{t:.2f}' for t in native)} | "
                      f"{dense:.2f} | {ours / dense:.2f} | {requantized} |", flush=True)


if __name__ == "__main__":
    main()
