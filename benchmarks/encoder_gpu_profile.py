"""Where the packed encoder's time goes on a GPU, next to transformers': one run answers it.

For each workload (an encoder shape with random bf16 weights, a number of mixed-length sentences):
1. end-to-end sentences/s of ours (CUDA graphs where a batch fits one, and enforce_eager) and of transformers
   (input order, length-sorted), interleaved medians, exactly as `fasterllm bench-embed` measures them;
2. the phases of one call of ours (host clock): tokenize, queue every batch's forward pass, wait for the device
   and copy the vectors back, turn them into Python lists;
3. tokens and GEMM work: real tokens (ours) against the padded tokens transformers computes;
4. torch.profiler over one call of ours and one of transformers (input order): kernel launches, the sum of
   kernel time against the wall time (how busy the GPU was), kernel time by kind, and the top kernels.

GPU:  .venv/bin/python benchmarks/encoder_gpu_profile.py
CPU smoke run:  .venv/bin/python benchmarks/encoder_gpu_profile.py --device cpu --dtype float32 \
          --workloads minilm-l6:16:1
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from fasterllm import LLM
from fasterllm.bench.embed import hf_embedder, mixed_sentences, report_interleaved_runs, sync, word_vocabulary
from fasterllm.bench.random_encoder import ENCODER_SHAPES, make_random_encoder

KERNEL_KINDS = [  # (kind, substrings of kernel names), first match wins
    ("GEMM", ("gemm", "cutlass", "nvjet", "cublas", "sm90_", "sm80_", "wgmma")),
    ("attention", ("attention", "fmha", "flash", "attn")),
    ("layer norm", ("layer_norm", "layernorm")),
    ("copy", ("memcpy", "memset", "copy")),
]


def print_phases(llm: LLM, sentences: list[str]) -> None:
    """One call of ours, split at the points where the host hands over to the device and back."""
    engine, device = llm.engine, llm.engine.device
    marks = {}
    sync(device)
    start = time.perf_counter()
    token_ids = engine.tokenize(sentences, truncate_prompt_tokens=-1)
    marks["tokenize (host)"] = time.perf_counter()

    batch_sizes = []

    def batch_queued(num_seqs: int) -> None:
        batch_sizes.append(num_seqs)
        marks["queue forward passes (host)"] = time.perf_counter()

    vectors = engine.embed(token_ids, on_batch=batch_queued)
    marks["wait for the device + copy back"] = time.perf_counter()
    vectors.tolist()
    marks["vectors to Python lists (host)"] = time.perf_counter()
    previous = start
    print(f"  phases of one call ({len(batch_sizes)} batches of <= {engine.max_num_batched_tokens} tokens, "
          f"{batch_sizes} sentences):")
    for name, mark in marks.items():
        print(f"    {name:34s} {(mark - previous) * 1e3:9.2f} ms")
        previous = mark
    print(f"    {'total':34s} {(previous - start) * 1e3:9.2f} ms")


def print_work(llm: LLM, sentences: list[str], shape: str, hf_batch_size: int) -> None:
    hidden, layers, _, intermediate = ENCODER_SHAPES[shape]
    lengths = [len(ids) for ids in llm.engine.tokenize(sentences, truncate_prompt_tokens=-1)]
    gemm_flops_per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * intermediate)

    def padded(order: list[int]) -> int:
        chunks = [order[i:i + hf_batch_size] for i in range(0, len(order), hf_batch_size)]
        return sum(len(chunk) * max(lengths[i] for i in chunk) for chunk in chunks)

    by_chars = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))  # as the peer sorts
    real, input_order, length_sorted = sum(lengths), padded(list(range(len(lengths)))), padded(by_chars)
    print(f"  tokens: real {real}; transformers computes {input_order} (input order, {input_order / real:.2f}x) "
          f"and {length_sorted} (length-sorted, {length_sorted / real:.2f}x)")
    print(f"  GEMM work: {real * gemm_flops_per_token / 1e9:.1f} GFLOP for the real tokens, "
          f"{input_order * gemm_flops_per_token / 1e9:.1f} / {length_sorted * gemm_flops_per_token / 1e9:.1f} "
          "GFLOP padded")


def print_profile(name: str, run, sentences: list[str], device: torch.device, rows: int) -> None:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run(sentences)
        sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    by_kind: dict[str, float] = defaultdict(float)
    for event in kernels:
        lowered = event.name.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in lowered for w in words)), "other (elementwise, ...)")
        by_kind[kind] += event.time_range.elapsed_us()
    print(f"\n  --- torch.profiler: {name} ---")
    print(f"  wall {wall_us / 1e3:.2f} ms (profiled: slower than unprofiled), {len(kernels)} device kernels/copies, "
          f"their sum {busy_us / 1e3:.2f} ms = {100 * busy_us / wall_us:.1f}% of the wall")
    for kind, us in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"    {kind:26s} {us / 1e3:9.2f} ms  {100 * us / max(busy_us, 1e-9):5.1f}% of kernel time")
    sort_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_key, row_limit=rows, max_name_column_width=60))


def profile_workload(shape: str, num_sentences: int, repeats: int, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix=f"random-{shape}-") as directory:
        make_random_encoder(Path(directory), shape)
        llm = LLM(model=directory, task="embed", device=args.device, dtype=args.dtype)
        eager = LLM(model=directory, task="embed", device=args.device, dtype=args.dtype, enforce_eager=True)
        device = llm.engine.device
        sentences = mixed_sentences(word_vocabulary(llm), num_sentences, 3, 120, seed=0)
        print(f"\n===== {shape}, {num_sentences} sentences, {args.dtype} on {device} "
              f"(max_num_batched_tokens {llm.engine.max_num_batched_tokens})")

        def ours(batch: list[str]) -> list:
            return llm.embed(batch, truncate_prompt_tokens=-1, use_tqdm=False)

        hf_input_order = hf_embedder(llm, args.hf_batch_size, sort_by_length=False)
        runners = {"fasterllm": ours,
                   "fasterllm, enforce_eager": lambda batch: eager.embed(batch, truncate_prompt_tokens=-1,
                                                                          use_tqdm=False),
                   "transformers, input order": hf_input_order,
                   "transformers, length-sorted": hf_embedder(llm, args.hf_batch_size, sort_by_length=True)}
        report_interleaved_runs(runners, sentences, repeats, device)
        print_phases(llm, sentences)
        print_work(llm, sentences, shape, args.hf_batch_size)
        print_profile("fasterllm", ours, sentences, device, args.rows)
        print_profile("transformers, input order", hf_input_order, sentences, device, args.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["minilm-l6:64:5", "bert-base:4096:3"],
                        help="SHAPE:SENTENCES:REPEATS, shapes: " + ", ".join(ENCODER_SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--rows", type=int, default=15, help="rows of each profiler table")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}")
    for workload in args.workloads:
        shape, sentences, repeats = workload.split(":")
        profile_workload(shape, int(sentences), int(repeats), args)


if __name__ == "__main__":
    main()
