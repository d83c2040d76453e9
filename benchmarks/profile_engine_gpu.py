"""Where a GPU engine's time goes: one workload run through Engine.step, first warm, then timed, then under
torch.profiler (GPU kernel time summed, top kernels by total time).

    python3 benchmarks/profile_engine_gpu.py --model DIR --load-format dummy [--quantization int8]
        [--num-prompts 64 --input-len 512 --output-len 256]

Wall time per step next to GPU kernel time per step tells a GPU-bound engine (they match) from a host-bound one.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fasterllm import SamplingParams
from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    engine = Engine(EngineArgs(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
                               gpu_memory_utilization=0.75, load_format=args.load_format,
                               quantization=args.quantization))
    generator = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size

    def run(tag: str) -> tuple[float, int]:
        for i in range(args.num_prompts):
            prompt = torch.randint(100, vocab, (args.input_len,), generator=generator).tolist()
            engine.add_request(f"{tag}{i}", prompt, SamplingParams(temperature=0, max_tokens=args.output_len,
                                                                   ignore_eos=True))
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        return time.perf_counter() - start, steps

    run("warm")
    wall, steps = run("timed")
    tokens = args.num_prompts * args.output_len
    print(f"{args.quantization or 'bf16'}: {wall:.3f} s, {steps} steps, {wall / steps * 1e3:.2f} ms a step, "
          f"{tokens / wall:.1f} output tok/s")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall, steps = run("profiled")
    gpu = sum(event.self_device_time_total for event in prof.key_averages()) / 1e6
    print(f"profiled: wall {wall:.3f} s, GPU time (kernels, copies, memsets) {gpu:.3f} s "
          f"({gpu / steps * 1e3:.2f} ms a step)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))


if __name__ == "__main__":
    main()
