"""The host's cost of a batched beam search (or, with --beam-width 0, greedy LLM.generate) on the CPU: wall and
process CPU time over random prompts, after a warm-up. With a tiny model (make_random_seq2seq.py --shape bart-tiny, make_random_llama.py --shape
llama-tiny) the matrix products are negligible, so this times the engine's own work per step; CPU time is steadier
than wall time on a machine that other jobs share. Run with OMP_NUM_THREADS=1 for the steadiest figures.

    python benchmarks/beam_host_cost.py /tmp/bart-tiny --num-prompts 64 --input-len 32 --output-len 64 --beam-width 4
    python benchmarks/beam_host_cost.py /tmp/llama-tiny --num-prompts 256 --beam-width 0   # greedy generate()
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--beam-width", type=int, default=4, help="0: greedy LLM.generate, no beam search")
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    import torch

    from fasterllm import LLM, BeamSearchParams, SamplingParams

    llm = LLM(ns.model, dtype="float32", device="cpu", max_num_seqs=ns.num_prompts * max(ns.beam_width, 1),
              enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)]
    if not llm.engine.model_config.is_encoder_decoder:
        prompts = [{"prompt_token_ids": p} for p in prompts]
    if ns.beam_width:
        params = BeamSearchParams(beam_width=ns.beam_width, max_tokens=ns.output_len, ignore_eos=True)
        run = llm.beam_search
    else:
        params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
        run = llm.generate
    run(prompts[:4], params, use_tqdm=False)
    walls, cpus = [], []
    for _ in range(ns.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    print(f"{ns.num_prompts} prompts x {ns.input_len} -> {ns.output_len} tokens, beam width {ns.beam_width or 'greedy'}, "
          f"torch threads {torch.get_num_threads()}: wall median {statistics.median(walls):.2f} s "
          f"{[round(w, 2) for w in walls]}, CPU median {statistics.median(cpus):.2f} s {[round(c, 2) for c in cpus]}")


if __name__ == "__main__":
    main()
