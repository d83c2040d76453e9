"""Greedy sampling's argmax on a GPU: the Triton kernel (kernels/argmax.py) against torch's, over Llama-3's 128,256
logits at 1-256 rows. GPU microseconds per call from CUDA-graph replays of 50 calls (median of 9), without an L2
flush: the engine's logits were just written. Checks both give the same indices first."""
import torch

from fasterllm.kernels.argmax import argmax_rows


def per_call(fn, calls=50):
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(9):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[4]


def main() -> None:
    for rows in (1, 4, 64, 256):
        x = torch.randn(rows, 128256, device="cuda")
        assert torch.equal(argmax_rows(x), x.argmax(-1))
        t_torch = per_call(lambda: x.argmax(-1))
        t_triton = per_call(lambda: argmax_rows(x))
        print(f"rows {rows}: torch {t_torch:.1f} us, triton {t_triton:.1f} us, ratio {t_torch / t_triton:.2f}x")


if __name__ == "__main__":
    main()
