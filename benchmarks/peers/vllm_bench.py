"""vLLM on `fasterllm bench`'s offline workloads: the same prompts (drawn by fasterllm.bench.offline.random_prompts
with the same seeds, from the same tokenizer and vocabulary), the same output lengths, greedy, ignore_eos, random
weights (vLLM's load_format="dummy") from a config-only directory (benchmarks/make_random_llama.py --config-only).
One JSON line per workload with vLLM's version and settings; run `fasterllm bench` with the same arguments in the
same session on the same GPU for our side. Several workloads share one vLLM start-up (about a minute cold):

    python3 benchmarks/peers/vllm_bench.py --model DIR --max-num-seqs 256 \
        --workload a:1:128:256 --workload c:64:512:256 --workload d:1000:256-1024:256

A workload is NAME:NUM_PROMPTS:INPUT_LEN[-INPUT_LEN_MAX]:OUTPUT_LEN (lengths uniform in the range, as
`fasterllm bench --input-len-max` draws them). Throughput is output tokens over the wall time of one generate() call
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
        name, num_prompts, lengths, output_len = spec.split(":")
        low, _, high = lengths.partition("-")
        return {"name": name, "num_prompts": int(num_prompts), "input_len": int(low),
                "input_len_max": int(high) if high else None, "output_len": int(output_len)}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"workload {spec!r} is not NAME:NUM_PROMPTS:INPUT_LEN[-MAX]:OUTPUT_LEN") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a config-only model directory (config.json, tokenizer)")
    parser.add_argument("--workload", type=parse_workload, action="append", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args()

    import vllm

    from fasterllm.bench.offline import random_prompts
    from fasterllm.loader.hf_checkpoint import load_hf_config
    from fasterllm.loader.tokenizer import load_hf_tokenizer

    directory = Path(args.model)
    config = load_hf_config(directory)
    # what random_prompts reads of an engine: its tokenizer's special ids and the vocabulary's size
    source = SimpleNamespace(tokenizer=load_hf_tokenizer(directory, config.eos_token_ids), model_config=config)
    settings = dict(model=str(directory), load_format="dummy", dtype="bfloat16", seed=args.seed,
                    max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization)
    if args.max_model_len:
        settings["max_model_len"] = args.max_model_len
    start = time.perf_counter()
    llm = vllm.LLM(**settings)
    startup = time.perf_counter() - start

    def generate(prompts: list[list[int]], max_tokens: int) -> float:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        begin = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - begin

    for workload in args.workload:
        num_prompts, input_len, output_len = workload["num_prompts"], workload["input_len"], workload["output_len"]
        generate(random_prompts(source, min(num_prompts, 4), input_len, seed=10**6), 4)  # warm-up, as ours
        runs = []
        for repeat in range(args.repeats):  # the seeds `fasterllm bench` uses for its runs
            prompts = random_prompts(source, num_prompts, input_len, args.seed + repeat,
                                     input_len_max=workload["input_len_max"])
            seconds = generate(prompts, output_len)
            run = {"seconds": round(seconds, 3), "output_tokens_per_s": round(num_prompts * output_len / seconds, 1)}
            if num_prompts == 1 and output_len > 1:
                run["tpot_ms"] = round(1e3 * (seconds - generate(prompts, 1)) / (output_len - 1), 3)
            runs.append(run)
        median = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
        print(json.dumps({"engine": "vllm", "version": vllm.__version__, "settings": settings,
                          "startup_s": round(startup, 1), "workload": {**workload, "greedy": True, "ignore_eos": True},
                          "median": median, "runs_output_tokens_per_s": [r["output_tokens_per_s"] for r in runs],
                          "spread": round(statistics.pstdev(r["output_tokens_per_s"] for r in runs), 1)}), flush=True)

if __name__ == "__main__":
    main()
