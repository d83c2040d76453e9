"""Where a batch-1 decode step's time goes on a GPU: the engine's step vs its CUDA graph replayed alone (the
difference is host work), then torch.profiler over five steps (kernel times by name, host calls).

    python3 benchmarks/decode_step_profile.py DIR [--dummy] [--quantization Q]
        # DIR: a model directory or .gguf file; --dummy: random weights (make_random_llama.py)
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fasterllm import SamplingParams
from fasterllm.config import QUANTIZATION_METHODS, EngineArgs
from fasterllm.engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dummy", action="store_true", help="random weights of the model's shape")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None)
    args = parser.parse_args()
    engine = Engine(EngineArgs(model=args.model, dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.5,
                               load_format="dummy" if args.dummy else "auto",
                               quantization=args.quantization))
    engine.add_request("r", list(range(100, 228)), SamplingParams(temperature=0, max_tokens=2 * args.steps + 200,
                                                                  ignore_eos=True))
    for _ in range(20):  # prefill and warm-up
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    graph = engine.executor.runner.graphs.graphs[1]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = begin.elapsed_time(end) / args.steps
    print(f"engine.step {step_ms:.3f} ms, graph replay alone {replay_ms:.3f} ms, host work outside the graph "
          f"{step_ms - replay_ms:.3f} ms")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
