"""One SmolLM2-135M decode step's matrix-vector products on the CPU, torch's kernels against ours
(kernels/native/cpu_gemv.py), in GB/s of weights read (the fastest of 20 steps), next to a plain bf16 read of 128 MB (torch.sum) as the DRAM
reference. The step: 30 layers of qkv / o / gate_up / down (int4 for quantization="int4"/"gguf", int8 for "int8")
and the 49,152-row head (int8 in both), one bf16 row each; random weights (speeds do not depend on values).
Bytes counted: codes plus the scales each kernel reads (ours: fp32 scales and minimums; torch's int4: bf16 pairs).

    python3 benchmarks/cpu_decode_gemv.py [--rows 1] [--isa avx2]
"""
from __future__ import annotations

import argparse
import time

import torch

from fasterllm.kernels.native import cpu_extension, cpu_gemv
from fasterllm.layers.quantization.int4 import GROUP_SIZE, scales_and_zeros

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2: qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)


def seconds(fn, repeats: int = 20) -> float:
    """The fastest of `repeats` timed calls (after one warm-up): the least disturbed by other work on the machine."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def int8_weights(shape):
    return torch.randint(-127, 128, shape, dtype=torch.int8), torch.rand(shape[0]) / 100


def int4_weights(shape):
    rows, cols = shape
    codes = torch.randint(0, 16, shape, dtype=torch.uint8)
    return codes, torch.rand(rows, cols // GROUP_SIZE) / 100, -torch.rand(rows, cols // GROUP_SIZE) / 10


def rows_and_isa(description: str) -> tuple[int, str]:
    """--rows and --isa from the command line (the ISA defaults to the CPU's), after checking our kernels run here."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rows", type=int, default=1, help="input rows per product (decode batch)")
    parser.add_argument("--isa", choices=sorted(cpu_extension.ISA_FLAGS), default=None, help="default: the CPU's")
    args = parser.parse_args()
    if not cpu_extension.available():
        raise SystemExit("the C++ kernels are not available here (see the warning above)")
    return args.rows, args.isa or cpu_extension.kernel_isa()


def main() -> None:
    rows_per_product, isa = rows_and_isa(__doc__.split("\n")[0])
    torch.manual_seed(0)
    head = int8_weights(HEAD_SHAPE)
    int8_layers = [int8_weights(shape) for shape in LAYER_SHAPES * 30]
    int4_layers = [int4_weights(shape) for shape in LAYER_SHAPES * 30]
    rows = {k: torch.randn(rows_per_product, k, dtype=torch.bfloat16) for k in (576, 1536)}

    torch_head = (head[0], head[1].bfloat16())
    torch_int8 = [(w, s.bfloat16()) for w, s in int8_layers]
    torch_int4 = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.to(torch.int32), 1),
                   scales_and_zeros(s, m, torch.bfloat16)) for c, s, m in int4_layers]
    ours_int4 = [cpu_gemv.pack_int4(c, s, m) for c, s, m in int4_layers]
    ours_int8 = [cpu_gemv.pack_int8(w, s) for w, s in int8_layers]
    ours_head = cpu_gemv.pack_int8(*head)

    def int8_bytes(layers):
        return sum(w.numel() + s.numel() * s.element_size() for w, s in layers)

    head_bytes = int8_bytes([head])
    steps = {
        "int8: torch _weight_int8pack_mm": (
            lambda: [torch._weight_int8pack_mm(rows[w.shape[1]], w, s) for w, s in torch_int8 + [torch_head]],
            int8_bytes(torch_int8) + head_bytes),
        "int8: ours int8_gemv": (
            lambda: [cpu_gemv.int8_gemv(rows[w.codes.shape[1] * 32], w, isa) for w in ours_int8 + [ours_head]],
            int8_bytes(int8_layers) + head_bytes),
        "int4: torch _weight_int4pack_mm_for_cpu (+ int8 head)": (
            lambda: [torch._weight_int4pack_mm_for_cpu(rows[p.shape[1] * 2], p, GROUP_SIZE, sz)
                     for p, sz in torch_int4] + [torch._weight_int8pack_mm(rows[576], *torch_head)],
            sum(p.numel() + sz.numel() * 2 for p, sz in torch_int4) + head_bytes),
        "int4: ours int4_gemv (+ our int8 head)": (
            lambda: [cpu_gemv.int4_gemv(rows[w.codes.shape[1] * 32], w, isa) for w in ours_int4]
            + [cpu_gemv.int8_gemv(rows[576], ours_head, isa)],
            sum(w.codes.numel() + 8 * w.scales.numel() for w in ours_int4) + head_bytes),
    }
    dram = torch.randn(64 << 20, dtype=torch.bfloat16)
    print(f"our ISA: {isa}; {rows_per_product} input row(s) per product")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        read = seconds(lambda: dram.sum(), repeats=5)
        print(f"{threads} thread(s): bf16 torch.sum {dram.numel() * 2 / read / 1e9:.1f} GB/s")
        for name, (step, nbytes) in steps.items():
            took = seconds(step)
            print(f"  {name:52s} {nbytes / 1e6:5.0f} MB {took * 1e3:6.2f} ms = {nbytes / took / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
