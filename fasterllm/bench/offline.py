"""`fasterllm bench`: N random prompts of fixed lengths through our engine, then through transformers."""
from __future__ import annotations

import random
import statistics
import time

import torch

from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine
from fasterllm.sampling_params import SamplingParams


def random_prompts(engine: Engine, num_prompts: int, input_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    special = engine.tokenizer.special_ids
    usable = [t for t in range(min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)) if t not in special]
    return [[rng.choice(usable) for _ in range(input_len)] for _ in range(num_prompts)]


def run_engine(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    wall_start = time.time()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params, arrival_time=wall_start)
    finished = []
    peak_blocks = 0
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
        peak_blocks = max(peak_blocks, engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.time_to_first_token for o in finished]
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (output_len - 1)
            for o in finished if output_len > 1]
    return {"seconds": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": len(prompts) * output_len / elapsed,
            "ttft_median_ms": 1e3 * statistics.median(ttft), "ttft_max_ms": 1e3 * max(ttft),
            "tpot_median_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
            "peak_kv_blocks": peak_blocks}


def load_transformers(engine: Engine):
    """The same weights through transformers (sdpa attention), in the engine's dtype and device."""
    from transformers import AutoModelForCausalLM

    source = engine.source
    kwargs = {"dtype": engine.dtype, "attn_implementation": "sdpa"}
    if source.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), **kwargs)
    return model.to(engine.device).eval()


def run_transformers(model, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """The workload through transformers' generate, all prompts in one batch (they share a length)."""
    ids = torch.tensor(prompts, device=model.device)

    def generate(batch: torch.Tensor, new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, pad_token_id=0,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        return time.perf_counter() - start

    with torch.inference_mode():
        generate(ids[:1, :8], 2)  # warm-up
        ttft = generate(ids, 1)
        elapsed = generate(ids, output_len)
    return {"seconds": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": len(prompts) * output_len / elapsed, "ttft_ms": 1e3 * ttft,
            "tpot_ms": 1e3 * (elapsed - ttft) / max(output_len - 1, 1)}


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (whole runs, so its figures stay consistent with each other)."""
    return sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]


def run_offline_bench(args: EngineArgs, num_prompts: int, input_len: int, output_len: int,
                      with_transformers: bool, repeats: int = 3) -> dict[str, dict[str, float]]:
    if min(num_prompts, input_len, output_len, repeats) < 1:
        raise ValueError(f"num_prompts={num_prompts}, input_len={input_len}, output_len={output_len}, "
                         f"repeats={repeats} must all be >= 1")
    engine = Engine(args)
    if input_len + output_len > engine.max_model_len:
        raise ValueError(f"input_len + output_len = {input_len + output_len} exceeds max_model_len="
                         f"{engine.max_model_len}; shorten them")
    prompts = random_prompts(engine, num_prompts, input_len, args.seed)
    hf_model = load_transformers(engine) if with_transformers else None
    print(f"workload: {num_prompts} prompts x {input_len} input tokens, {output_len} output tokens (greedy, "
          f"ignore_eos); model {engine.model_name}, {str(engine.dtype).removeprefix('torch.')} on {engine.device}, "
          f"torch threads {torch.get_num_threads()}; median of {repeats} interleaved runs")
    run_engine(engine, prompts[:1], 4)  # warm-up
    ours_runs, hf_runs = [], []
    for _ in range(repeats):  # interleaved, so a noisy spell on the machine hits both
        ours_runs.append(run_engine(engine, prompts, output_len))
        if hf_model is not None:
            hf_runs.append(run_transformers(hf_model, prompts, output_len))
    ours = _median_run(ours_runs)
    stats = engine.stats()
    print(f"fasterllm     : {ours['requests_per_s']:8.2f} req/s {ours['output_tokens_per_s']:9.1f} output tok/s  "
          f"TTFT median {ours['ttft_median_ms']:8.1f} ms (max {ours['ttft_max_ms']:.1f})  "
          f"TPOT median {ours['tpot_median_ms']:6.2f} ms  peak KV blocks {ours['peak_kv_blocks']}/{stats.num_kv_blocks}"
          f"  preemptions {stats.num_preemptions} (swaps out/in {stats.num_swapped_out}/{stats.num_swapped_in})  "
          f"prefix cache hit rate {stats.prefix_cache_hit_rate:.1%}")
    results = {"fasterllm": ours}
    if hf_runs:
        hf = results["transformers"] = _median_run(hf_runs)
        print(f"transformers  : {hf['requests_per_s']:8.2f} req/s {hf['output_tokens_per_s']:9.1f} output tok/s  "
              f"TTFT {hf['ttft_ms']:8.1f} ms  TPOT {hf['tpot_ms']:6.2f} ms  (batched generate, sdpa)")
        print(f"ratio (output tok/s, fasterllm / transformers): {ours['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x")
    return results
