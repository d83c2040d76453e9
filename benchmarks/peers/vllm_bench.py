"""vLLM on `fasterllm bench`'s offline workloads: the same prompts (drawn by fasterllm.bench.offline.random_prompts
with the same seeds, from the same tokenizer and vocabulary), the same output lengths, greedy, ignore_eos, random
weights (vLLM's load_format="dummy") from a config-only directory (benchmarks/make_random_llama.py --config-only).
One JSON line per workload with vLLM's version and settings; run `fasterllm bench` with the same arguments in the
same session on the same GPU for our side. Several workloads share one vLLM start-up (about a minute cold):

    python3 benchmarks/peers/vllm_bench.py --model DIR --max-num-seqs 256 \
        --workload a:1:128:256 --workload c:64:512:256 --workload d:1000:256-1024:256

A workload is NAME:NUM_PROMPTS:INPUT_LEN[-INPUT_LEN_MAX]:OUTPUT_LEN (lengths uniform in the range, as
`fasterllm bench --input-len-max` draws them), or NAME:NUM_PROMPTS:sharegpt (each request's lengths as
`fasterllm bench --sharegpt-like` draws them, fasterllm/bench/sharegpt_like.py). Throughput is output tokens over the wall time of one generate() call
holding every prompt (as `fasterllm bench` adds them all at once), the median of --repeats runs after a warm-up.
With one prompt, TPOT is taken as vLLM's offline API gives no per-token times: (time of the N-token generate - time
of a 1-token generate) / (N - 1). ../shared/peers/vllm-0.25.md says what running vLLM 0.25.0 on the GPU machines
takes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace


def parse_workload(spec: str) -> dict:
    try:
        if spec.endswith(":sharegpt"):  # NAME:NUM_PROMPTS:sharegpt, `fasterllm bench --sharegpt-like`'s lengths
            name, num_prompts, _ = spec.split(":")
            return {"name": name, "num_prompts": int(num_prompts), "sharegpt_like": True}
        name, num_prompts, lengths, output_len = spec.split(":")
        low, _, high = lengths.partition("-")
        return {"name": name, "num_prompts": int(num_prompts), "input_len": int(low),
                "input_len_max": int(high) if high else None, "output_len": int(output_len)}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"workload {spec!r} is not NAME:NUM_PROMPTS:INPUT_LEN[-MAX]:OUTPUT_LEN or "
                                         "NAME:NUM_PROMPTS:sharegpt") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a config-only model directory (config.json, tokenizer)")
    parser.add_argument("--workload", type=parse_workload, action="append", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    args = parser.parse_args()

    import vllm

    from fasterllm.bench.offline import random_prompts
    from fasterllm.bench.sharegpt_like import MIN_LEN, sharegpt_like_lengths
    from fasterllm.loader.hf_checkpoint import load_hf_config
    from fasterllm.loader.tokenizer import load_hf_tokenizer

    directory = Path(args.model)
    config = load_hf_config(directory)
    # what random_prompts reads of an engine: its tokenizer's special ids and the vocabulary's size
    source = SimpleNamespace(tokenizer=load_hf_tokenizer(directory, config.eos_token_ids), model_config=config)
    settings = dict(model=str(directory), load_format="dummy", dtype="bfloat16", seed=args.seed,
                    max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                    kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size)
    if args.max_model_len:
        settings["max_model_len"] = args.max_model_len
    start = time.perf_counter()
    llm = vllm.LLM(**settings)
    startup = time.perf_counter() - start

    def generate(prompts: list[list[int]], output_lens: list[int]) -> float:
        params = [vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        begin = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - begin

    for workload in args.workload:
        num_prompts, sharegpt = workload["num_prompts"], workload.get("sharegpt_like", False)
        input_len = MIN_LEN if sharegpt else workload["input_len"]
        warm_up = random_prompts(source, min(num_prompts, 4), input_len, seed=10**6)
        generate(warm_up, [4] * len(warm_up))  # as ours
        runs = []
        for repeat in range(args.repeats):  # the seeds `fasterllm bench` uses for its runs
            if sharegpt:
                prompt_lens, output_lens = sharegpt_like_lengths(num_prompts, args.seed + repeat)
                prompts = random_prompts(source, num_prompts, 0, args.seed + repeat, lengths=prompt_lens)
            else:
                prompts = random_prompts(source, num_prompts, input_len, args.seed + repeat,
                                         input_len_max=workload["input_len_max"])
                output_lens = [workload["output_len"]] * num_prompts
            seconds = generate(prompts, output_lens)
            run = {"seconds": round(seconds, 3), "output_tokens_per_s": round(sum(output_lens) / seconds, 1)}
            if num_prompts == 1 and output_lens[0] > 1:
                run["tpot_ms"] = round(1e3 * (seconds - generate(prompts, [1])) / (output_lens[0] - 1), 3)
            runs.append(run)
        median = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
        print(json.dumps({"engine": "vllm", "version": vllm.__version__, "settings": settings,
                          "startup_s": round(startup, 1), "workload": {**workload, "greedy": True, "ignore_eos": True},
                          "median": median, "runs_output_tokens_per_s": [r["output_tokens_per_s"] for r in runs],
                          "spread": round(statistics.pstdev(r["output_tokens_per_s"] for r in runs), 1)}), flush=True)

if __name__ == "__main__":
    main()
