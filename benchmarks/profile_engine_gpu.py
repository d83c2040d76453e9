"""Where a GPU engine's time goes: one workload run through Engine.step, first warm, then timed, then under
torch.profiler (GPU kernel time summed, top kernels by total time).

    python3 benchmarks/profile_engine_gpu.py --model DIR --load-format dummy [--quantization int8]
        [--num-prompts 64 --input-len 512 [--input-len-max 1024] --output-len 256 --max-num-seqs 256]
        [--beam-width 4] [--host-profile 40]

Wall time per step next to GPU kernel time per step tells a GPU-bound engine (they match) from a host-bound one.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

from torch.profiler import ProfilerActivity, profile

from fasterllm.bench.offline import random_prompts, run_engine
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
    parser.add_argument("--input-len-max", type=int, default=None, help="prompt lengths uniform in [input-len, this]")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--beam-width", type=int, default=1, help="> 1: beam search of this width per prompt")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also print the N host functions with the most cumulative time (cProfile, timed run)")
    args = parser.parse_args()
    engine = Engine(EngineArgs(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
                               gpu_memory_utilization=0.75, load_format=args.load_format,
                               quantization=args.quantization, max_num_seqs=args.max_num_seqs))

    def run(seed: int) -> dict[str, float]:  # fresh prompts each run: no prefix-cache hits
        prompts = random_prompts(engine, args.num_prompts, args.input_len, seed, input_len_max=args.input_len_max)
        return run_engine(engine, prompts, args.output_len, sequences=args.beam_width,
                          beam_search=args.beam_width > 1)

    run(0)  # warm-up
    timed = run(1)
    if args.host_profile:
        host = cProfile.Profile()
        host.runcall(run, 3)
        pstats.Stats(host).sort_stats("cumulative").print_stats(args.host_profile)
    print(f"{args.quantization or 'bf16'}: {timed['seconds']:.3f} s, {timed['steps']} steps, "
          f"{timed['seconds'] / timed['steps'] * 1e3:.2f} ms a step, {timed['output_tokens_per_s']:.1f} output tok/s")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled = run(2)
    gpu = sum(event.self_device_time_total for event in prof.key_averages()) / 1e6
    print(f"profiled: wall {profiled['seconds']:.3f} s, GPU time (kernels, copies, memsets) {gpu:.3f} s "
          f"({gpu / profiled['steps'] * 1e3:.2f} ms a step)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
