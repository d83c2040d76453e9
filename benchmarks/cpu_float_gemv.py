"""One fp32 decode step's matrix products on the CPU: oneDNN's over its packed weights (layers/linear.PackedCPULinear),
ours over tiles (TiledCPULinear, kernels/native/cpu_gemv.float_gemv) and torch's F.linear over the plain weights, in
GB/s of weights read (the fastest of 20 steps; every weight of the step read from DRAM, as a real step reads them),
next to a plain fp32 read of 256 MB (torch.sum) as the DRAM reference. The steps: Marian-base's decoder (6 layers of
qkv / out / cross q / cross out / fc1 / fc2, and its 58,101-row head) and SmolLM2-135M's (30 layers of qkv / o /
gate_up / down, and its 49,152-row head); random weights (speeds do not depend on values).

    python3 benchmarks/cpu_float_gemv.py [--rows 1] [--isa avx2]
"""
from __future__ import annotations

import torch

from cpu_decode_gemv import rows_and_isa, seconds  # benchmarks/, the script's own folder
from fasterllm.kernels.native import cpu_gemv
from fasterllm.layers.linear import pack_weight

STEPS = {
    "Marian-base": [(1536, 512), (512, 512), (512, 512), (512, 512), (2048, 512), (512, 2048)] * 6 + [(58101, 512)],
    "SmolLM2-135M": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)],
}


def time_step(model: str, shapes: list[tuple[int, int]], rows: int, isa: str) -> None:
    """Print each kernel's time for one step of these products (one input of `rows` rows per width)."""
    weights = [torch.randn(shape) / shape[1] ** 0.5 for shape in shapes]
    inputs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
    packed = [pack_weight(w) for w in weights]
    tiles = [cpu_gemv.pack_float(w) for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    steps = {
        "oneDNN, packed": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
                                   for w, p in zip(weights, packed)],
        "ours, tiles": lambda: [cpu_gemv.float_gemv(inputs[w.shape[1]], t, None, isa) for w, t in zip(weights, tiles)],
        "F.linear, plain": lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights],
    }
    for name, step in steps.items():
        took = seconds(step)
        print(f"  {model:13s} {name:15s} {nbytes / 1e6:5.0f} MB {took * 1e3:7.2f} ms = {nbytes / took / 1e9:5.1f} GB/s")


def main() -> None:
    rows, isa = rows_and_isa(__doc__.split("\n")[0])
    torch.manual_seed(0)
    dram = torch.randn(64 << 20)
    print(f"our ISA: {isa}; {rows} input row(s) per product; {torch.get_num_threads()} thread(s): fp32 "
          f"torch.sum {dram.numel() * 4 / seconds(dram.sum, repeats=5) / 1e9:.1f} GB/s")
    for model, shapes in STEPS.items():
        time_step(model, shapes, rows, isa)


if __name__ == "__main__":
    main()
