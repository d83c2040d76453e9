"""The llama.cpp peer for single-stream decode: its own GGUF file, greedy, N new tokens after a prompt of
random tokens, the same shape as `fasterllm bench --num-prompts 1 --input-len 32 --output-len 128`.

llama-cpp-python is not a fasterllm dependency: build it in a scratch venv outside the repo and run
this file with that venv's python (it imports llama_cpp only; no fasterllm import):

    python3 -m venv /tmp/llamavenv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamavenv/bin/pip install llama-cpp-python   # ~4 min to compile
    /tmp/llamavenv/bin/python benchmarks/llama_cpp_decode.py MODEL.gguf --threads 2

Prints decode tok/s (new tokens after the first / time after the first) per repeat and their median.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def decode_tokens_per_second(llm, prompt: list[int], output_len: int) -> float:
    llm.reset()  # no KV reuse between repeats: each run computes its prompt again
    times = []
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        if len(times) == output_len:
            break
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a .gguf file")
    parser.add_argument("--threads", type=int, required=True, help="the thread count of the run compared with")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import llama_cpp  # only in the scratch venv

    llm = llama_cpp.Llama(args.model, n_ctx=args.input_len + args.output_len + 8, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, llm.n_vocab()) for _ in range(args.input_len)]
    runs = [decode_tokens_per_second(llm, prompt, args.output_len) for _ in range(args.repeats)]
    print(f"llama.cpp {llama_cpp.__version__}, {args.threads} threads: decode "
          f"{', '.join(f'{r:.1f}' for r in runs)} tok/s; median {statistics.median(runs):.1f}")


if __name__ == "__main__":
    main()
