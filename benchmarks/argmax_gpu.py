"""Greedy sampling's argmax on a GPU: the Triton kernel (kernels/argmax.py) against torch's, over Llama-3's 128,256
logits at 1-256 rows. GPU microseconds per call from CUDA-graph replays (quant_kernels_gpu.time_it) without an L2
flush: the engine's logits were just written. Checks both give the same indices first."""
import torch

from quant_kernels_gpu import time_it

from fasterllm.kernels.argmax import argmax_rows


def main() -> None:
    for rows in (1, 4, 64, 256):
        x = torch.randn(rows, 128256, device="cuda")
        assert torch.equal(argmax_rows(x), x.argmax(-1))
        t_torch = 1e6 * time_it(lambda: x.argmax(-1), flush_l2=False)
        t_triton = 1e6 * time_it(lambda: argmax_rows(x), flush_l2=False)
        print(f"rows {rows}: torch {t_torch:.1f} us, triton {t_triton:.1f} us, ratio {t_torch / t_triton:.2f}x")


if __name__ == "__main__":
    main()
