"""Quantized GPU kernels at the Llama-3-8B shapes: correctness against the reference and speed against torch's bf16
matmul, measured in the same run (one GPU call answers both "is it right" and "how fast").

    python3 benchmarks/quant_kernels_gpu.py                 # every kernel, rows 1, 16, 64, 512
    python3 benchmarks/quant_kernels_gpu.py --rows 1 64     # fewer

Each line: kernel, shape, GPU time (see time_it: CUDA graphs, L2 flushed before every call), GB/s of weight bytes
read (scales included) and the speed-up over bf16 F.linear of the same shape, and the worst error against its
reference relative to the output's largest value (NaN fails). "int4" is the layer the engine builds for bf16
(tinygemm's layout on NVIDIA GPUs of compute capability 8.0+: int4_gemv.py's Gluon kernel at one row, int4_mma.py's
at 2-64 rows; where Triton has no Gluon, torch's kernel up to 4 rows and our Triton kernel above), "int4-rows" the
row-major layout of fp16 and fp32 models, "int4:FORM" (2-64 rows, where Triton has Gluon) each form of int4_mma.py
the GPU runs at those rows with its tile timed fastest ("int4" takes the fastest form); at one row "int8" is
int8_gemv.py's Gluon kernel on NVIDIA GPUs and "gemv-int8" gemv.py's Triton kernel on the same codes. A kernel that
raises prints its error and the run goes on. Random weights (std 0.02) and activations; bf16.
"""
from __future__ import annotations

import argparse
import traceback

import torch
import torch.nn.functional as F

from fasterllm.kernels.quant_activation import (quantize_per_token, quantize_per_token_reference, rms_norm_quantize,
                                                silu_and_mul_quantize)
from fasterllm.kernels import gemv, tile_timer
from fasterllm.kernels.quant_w8a8 import int8_gemm, int8_gemm_reference
from fasterllm.kernels.quant_weight_only import (dequantize_reference, pack_int4_codes, tinygemm_reference,
                                                 weight_only_matmul, weight_only_matmul_reference)
from fasterllm.layers.activation import act_and_mul
from fasterllm.layers.norm import RMSNorm
from fasterllm.layers.quantization.gpu import FP8Linear, Int4GPULinear
from fasterllm.layers.quantization.int4 import GROUP_SIZE, quantize_int4_grouped
from fasterllm.layers.quantization.int8 import quantize_int8_per_channel

try:
    from fasterllm.kernels import int4_mma
except ImportError:  # Triton without Gluon: no "int4:FORM" rows
    int4_mma = None

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (2 * 14336, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def report(name: str, shape: str, seconds: float, weight_bytes: int, bf16_seconds: float, error: float) -> None:
    ok = "ok" if error == error and error < 0.1 else "WRONG"
    print(f"{name:10s} {shape:24s} {seconds * 1e6:9.1f} us {weight_bytes / seconds / 1e9:8.0f} GB/s "
          f"{bf16_seconds / seconds:6.2f}x bf16   max err {error:.2e} {ok}", flush=True)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


_CALLS_PER_GRAPH = 20


def time_it(fn, flush_l2: bool = True) -> float:
    """GPU seconds per call: a CUDA graph of 20 x (flush L2, call) minus a graph of the 20 flushes alone, medians
    of 7 replays. Graphs, as the engine's decode runs these kernels: timed eagerly, a few-microsecond kernel
    measures its Python launch instead (do_bench timed 95-370 us for kernels that take 15-25 us on the GPU).
    flush_l2=False: a graph of the 20 calls alone, for inputs a step has just written (still in L2)."""
    fn()  # compile, and let first-call tile timing (tile_timer.py) happen outside the capture

    def replay_seconds(body) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(_CALLS_PER_GRAPH):
                body()
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[3]

    if not flush_l2:
        return replay_seconds(fn) / _CALLS_PER_GRAPH
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    flushes = replay_seconds(flush.zero_)
    both = replay_seconds(lambda: (flush.zero_(), fn()))
    return max(both - flushes, 0.0) / _CALLS_PER_GRAPH


def bench_matmuls(rows: list[int]) -> None:
    for layer, (n, k) in SHAPES.items():
        bench_layer(layer, n, k, rows)
        torch.cuda.empty_cache()


def bench_layer(layer: str, n: int, k: int, rows: list[int]) -> None:
    """One projection's weight in every format, each row count; the weights are freed on return."""
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q8, s8 = quantize_int8_per_channel(weight)
    codes, s4, m4 = quantize_int4_grouped(weight)
    q4, s4, m4 = pack_int4_codes(codes), s4.half(), m4.half()
    int4 = Int4GPULinear(codes, s4, m4, None, weight.dtype)  # bf16: tinygemm's layout, as the engine runs it
    # torch's reading of the codes and the scales the layer stored (not our kernels')
    int4_weight = (tinygemm_reference(codes, int4.scale_zeros, GROUP_SIZE) if int4.tinygemm
                   else dequantize_reference(q4, s4, m4, GROUP_SIZE))
    del codes
    int4_bytes = n * k // 2 + 4 * n * k // GROUP_SIZE  # codes, and a 4-byte scale and zero a group
    try:
        fp8 = FP8Linear.from_float(weight, None)
    except ValueError as exc:  # not a Hopper GPU: the fp8 rows print this
        print(f"fp8 unavailable: {exc}", flush=True)
        fp8 = None
    for m in rows:
        shape = f"{layer} {m}x{n}x{k}"
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16 = time_it(lambda: F.linear(x, weight))
        report("bf16", shape, bf16, 2 * n * k, bf16, 0.0)
        qx, sx = quantize_per_token(x)
        cases = {
            "int8": (lambda: weight_only_matmul(x, q8, s8), lambda: weight_only_matmul_reference(x, q8, s8),
                     n * k + 4 * n),
            "int4": (lambda: int4.matmul(x), lambda: x.float() @ int4_weight.t(), int4_bytes),
            "int4-rows": (lambda: weight_only_matmul(x, q4, s4, None, m4, GROUP_SIZE),
                          lambda: weight_only_matmul_reference(x, q4, s4, None, m4, GROUP_SIZE), int4_bytes),
            "w8a8": (lambda: int8_gemm(*quantize_per_token(x), q8, s8, None, x.dtype),
                     lambda: int8_gemm_reference(*quantize_per_token_reference(x), q8, s8, None, x.dtype),
                     n * k + 4 * n),
            "w8a8-gemm": (lambda: int8_gemm(qx, sx, q8, s8, None, x.dtype),
                          lambda: int8_gemm_reference(qx, sx, q8, s8, None, x.dtype), n * k + 4 * n),
        }
        if fp8 is not None:  # Hopper only: the line above said why it is missing
            cases["fp8"] = (lambda: fp8(x), lambda: x.float() @ (fp8.qweight.float() * fp8.scales.t()).t(),
                            n * k + 4 * n)
        if int4_mma is not None and int4.tinygemm and 2 <= m <= int4_mma.MAX_ROWS:  # each form of the Gluon kernel
            for form in int4_mma.forms_for(m, x.device):
                cases[f"int4:{form}"] = (
                    lambda form=form: int4_mma.int4_mma(x, int4.qweight, int4.scale_zeros, int4.group_size, form=form),
                    lambda: x.float() @ int4_weight.t(), int4_bytes)
        if m == 1:  # the matrix-vector kernel on the bf16 weight itself, against cuBLAS (the bf16 row)
            cases["gemv-bf16"] = (lambda: gemv.gemv(x, weight),
                                  lambda: (x.float() @ weight.float().t()).to(x.dtype), 2 * n * k)
            # gemv.py's Triton kernel on the int8 codes, beside "int8" (int8_gemv.py's Gluon kernel on NVIDIA GPUs)
            cases["gemv-int8"] = (lambda: gemv.gemv(x, q8, s8), lambda: weight_only_matmul_reference(x, q8, s8),
                                  n * k + 4 * n)
        for name, (run, reference, weight_bytes) in cases.items():
            try:
                error = relative(run(), reference())
                report(name, shape, time_it(run), weight_bytes, bf16, error)
            except Exception:  # keep measuring the others; say what failed
                print(f"{name:10s} {shape:24s} FAILED:\n{traceback.format_exc(limit=3)}", flush=True)
        if m > 16:  # torch's own int8 GEMM (no epilogue) as a peer of w8a8-gemm
            try:
                q8t = q8.t()
                report("_int_mm", shape, time_it(lambda: torch._int_mm(qx, q8t)), n * k, bf16, 0.0)
            except Exception as exc:
                print(f"_int_mm    {shape:24s} FAILED: {exc}", flush=True)


def bench_quantizers(rows: list[int]) -> None:
    norm = RMSNorm(4096, 1e-5).to("cuda", torch.bfloat16)
    for m in rows:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        gate_up = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16)
        cases = {
            "quant": (lambda: quantize_per_token(x)[0], lambda: quantize_per_token_reference(x)[0], 3 * x.numel()),
            "silu+q": (lambda: silu_and_mul_quantize(gate_up)[0],
                       lambda: quantize_per_token_reference(act_and_mul(gate_up))[0], 5 * gate_up.numel() // 2),
            "norm+q": (lambda: rms_norm_quantize(x, residual, norm.weight, 1e-5)[0],
                       lambda: quantize_per_token_reference(norm(x, residual)[0])[0], 7 * x.numel()),
        }
        for name, (run, reference, moved_bytes) in cases.items():
            try:
                codes_off = (run().float() - reference().float()).abs().max().item()  # codes: off by one at ties
                seconds = time_it(run)
                print(f"{name:10s} rows {m:<19d} {seconds * 1e6:9.1f} us {moved_bytes / seconds / 1e9:8.0f} GB/s "
                      f"moved   max code diff {codes_off:.0f} {'ok' if codes_off <= 1 else 'WRONG'}", flush=True)
            except Exception:
                print(f"{name:10s} rows {m:<19d} FAILED:\n{traceback.format_exc(limit=3)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bench_quantizers(args.rows)
    bench_matmuls(args.rows)
    for key, tile in tile_timer.chosen_tiles().items():  # what the first calls timed best
        print(f"matrix-vector tile for {key}: {tile}", flush=True)


if __name__ == "__main__":
    main()
