"""Where a GPU engine's time goes: one workload run through Engine.step, first warm, then timed, then under
torch.profiler on every rank (GPU kernel time summed, top kernels by total time; with tensor parallelism, each
rank's in its worker process).

    python3 benchmarks/profile_engine_gpu.py --model DIR --load-format dummy [--quantization int8]
        [--num-prompts 64 --input-len 512 [--input-len-max 1024] --output-len 256 --max-num-seqs 256]
        [--beam-width 4] [--host-profile 40] [--tensor-parallel-size 2 [--trace-dir DIR]]

Wall time per step next to GPU kernel time per step tells a GPU-bound engine (they match) from a host-bound one.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

from fasterllm.bench.offline import random_prompts, run_engine
from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine
from fasterllm.worker import profiler


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
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--trace-dir", default=None, help="write each rank's Chrome trace here (rank<N>.json)")
    args = parser.parse_args()
    engine = Engine(EngineArgs(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
                               gpu_memory_utilization=0.75, load_format=args.load_format,
                               quantization=args.quantization, max_num_seqs=args.max_num_seqs,
                               tensor_parallel_size=args.tensor_parallel_size))

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
    engine.executor.collective_rpc(profiler.start)
    profiled = run(2)
    for rank in engine.executor.collective_rpc(profiler.stop, args.trace_dir):
        gpu = rank["seconds"]
        print(f"profiled, rank {rank['rank']}: wall {profiled['seconds']:.3f} s, GPU time (kernels, copies, memsets) "
              f"{gpu:.3f} s ({gpu / profiled['steps'] * 1e3:.2f} ms a step)")
        print(rank["table"])
    engine.shutdown()


if __name__ == "__main__":
    main()
