"""`fasterllm bench`: N random prompts of fixed lengths through our engine, then through transformers."""
from __future__ import annotations

import random
import statistics
import time

import torch

from fasterllm.bench.sharegpt_like import INPUT_MAX, INPUT_MEDIAN, MIN_LEN, OUTPUT_MAX, OUTPUT_MEDIAN, sharegpt_like_lengths
from fasterllm.bench.stats import percentile
from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine
from fasterllm.engine.frozen_heap import heap_frozen_while_generating
from fasterllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def random_prompts(engine: Engine, num_prompts: int, input_len: int, seed: int = 0,
                   shared_prefix_len: int = 0, input_len_max: int | None = None,
                   lengths: list[int] | None = None) -> list[list[int]]:
    """Random token prompts; with shared_prefix_len, all start with the same random prefix; with
    input_len_max, lengths are uniform in [input_len, input_len_max]; lengths: each prompt's own."""
    rng = random.Random(seed)
    special = engine.tokenizer.special_ids
    usable = [t for t in range(min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)) if t not in special]
    prefix = [rng.choice(usable) for _ in range(shared_prefix_len)]
    if lengths is None:
        lengths = [rng.randint(input_len, input_len_max or input_len) for _ in range(num_prompts)]
    return [prefix + [rng.choice(usable) for _ in range(length)] for length in lengths]


def run_engine(engine: Engine, prompts: list[list[int]], output_len: int | list[int],
               late_prompt: list[int] | None = None, sequences: int = 1, beam_search: bool = False,
               final_only: bool = False) -> dict[str, float]:
    """All prompts arrive at once; late_prompt (if any) arrives once every one of them is decoding.

    output_len: one for all, or each prompt's. sequences > 1: that many per prompt, sampled (n, temperature 1) or,
    with beam_search, beams. Inter-token latencies (ITL) are those of the prompts' requests, the late one excluded.
    final_only (not with late_prompt, which waits for every request's first token): each request yields its final
    output only, as LLM.generate asks; TTFT and TPOT then come from the requests' timestamps, and there is no ITL.
    """
    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    output_lens = output_len if isinstance(output_len, list) else [output_len] * len(prompts)

    def params(max_tokens: int) -> SamplingParams | BeamSearchParams:
        if beam_search:
            return BeamSearchParams(beam_width=sequences, max_tokens=max_tokens, ignore_eos=True)
        return SamplingParams(n=sequences, temperature=0.0 if sequences == 1 else 1.0, seed=0, max_tokens=max_tokens,
                              ignore_eos=True, output_kind=kind)

    start = time.perf_counter()
    wall_start = time.time()
    for i, (prompt, max_tokens) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"bench-{i}", prompt, params(max_tokens), arrival_time=wall_start)
    token_times: dict[str, list[float]] = {f"bench-{i}": [] for i in range(len(prompts))}
    finished = []
    peak_blocks = steps = 0
    with heap_frozen_while_generating():  # as LLM.generate and the server's engine process run
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            now = time.perf_counter()
            for output in outputs:
                if output.request_id in token_times:
                    token_times[output.request_id].append(now)
                if output.finished:
                    finished.append(output)
            if late_prompt is not None and all(token_times.values()):
                engine.add_request("bench-late", late_prompt, SamplingParams(temperature=0.0, max_tokens=1))
                late_prompt = None
            peak_blocks = max(peak_blocks, engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.time_to_first_token for o in finished if o.request_id in token_times]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    if final_only:
        tpot = [t for o in finished if (t := o.metrics.time_per_output_token(len(o.outputs[0].token_ids)))
                is not None]
    else:
        tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times.values() if len(times) > 1]
    return {"seconds": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": sum(output_lens) * sequences / elapsed,
            "ttft_median_ms": 1e3 * statistics.median(ttft), "ttft_max_ms": 1e3 * max(ttft),
            "tpot_median_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "itl_max_ms": 1e3 * max(itl) if itl else float("nan"),
            "peak_kv_blocks": peak_blocks, "steps": steps}


def load_transformers(engine: Engine):
    """The same weights through transformers (sdpa attention), in the engine's dtype and device."""
    import transformers

    AutoModelForCausalLM = (transformers.AutoModelForSeq2SeqLM if engine.model_config.is_encoder_decoder  # noqa: N806
                            else transformers.AutoModelForCausalLM)
    source = engine.source
    kwargs = {"dtype": engine.dtype, "attn_implementation": "sdpa"}
    if engine.args.load_format == "dummy":  # random weights too (transformers' own initialisation)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(source.path))
        with torch.device(engine.device):
            return AutoModelForCausalLM.from_config(config, **kwargs).eval()
    if source.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), **kwargs)
    return model.to(engine.device).eval()


def run_transformers(model, prompts: list[list[int]], output_len: int, sequences: int = 1,
                     beam_search: bool = False) -> dict[str, float]:
    """The workload through transformers' generate, all prompts in one batch (they share a length); an
    encoder-decoder model takes them as its encoder inputs. None of the checkpoint's own generation defaults
    (forced tokens, repeat bans) apply: our engine applies none either."""
    ids = torch.tensor(prompts, device=model.device)
    if beam_search:
        decoding = {"do_sample": False, "num_beams": sequences, "num_return_sequences": sequences}
    elif sequences > 1:
        decoding = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_return_sequences": sequences,
                    "num_beams": 1}
    else:
        decoding = {"do_sample": False, "num_beams": 1}
    decoding.update(forced_bos_token_id=None, forced_eos_token_id=None, no_repeat_ngram_size=0)

    def generate(batch: torch.Tensor, new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(batch, attention_mask=torch.ones_like(batch), pad_token_id=0, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, **decoding)
        return time.perf_counter() - start

    with torch.inference_mode():
        generate(ids[:1, :8], 2)  # warm-up
        ttft = generate(ids, 1)
        elapsed = generate(ids, output_len)
    return {"seconds": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": len(prompts) * output_len * sequences / elapsed, "ttft_ms": 1e3 * ttft,
            "tpot_ms": 1e3 * (elapsed - ttft) / max(output_len - 1, 1)}


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (whole runs, so its figures stay consistent with each other)."""
    return sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]


def run_offline_bench(args: EngineArgs, num_prompts: int, input_len: int, output_len: int,
                      with_transformers: bool, repeats: int = 3, shared_prefix_len: int = 0,
                      long_prompt_len: int = 0, input_len_max: int | None = None, sequences: int = 1,
                      beam_search: bool = False, sharegpt_like: bool = False,
                      final_only: bool = False) -> dict[str, dict[str, float]]:
    """sharegpt_like: workload (e), each request's prompt and output lengths from bench/sharegpt_like.py (input_len
    and output_len then only size the warm-up and the length checks' upper bounds). final_only: requests yield only
    their final output (run_engine)."""
    if sharegpt_like:
        input_len, input_len_max, output_len = MIN_LEN, INPUT_MAX, OUTPUT_MAX
    if min(num_prompts, input_len, output_len, repeats) < 1 or min(shared_prefix_len, long_prompt_len) < 0:
        raise ValueError(f"num_prompts={num_prompts}, input_len={input_len}, output_len={output_len}, "
                         f"repeats={repeats} must all be >= 1 (shared_prefix_len, long_prompt_len >= 0)")
    if input_len_max is not None and input_len_max < input_len:
        raise ValueError(f"input_len_max={input_len_max} must be >= input_len={input_len}")
    if (input_len_max is not None or sharegpt_like) and with_transformers:
        raise ValueError("mixed prompt lengths run through our engine only; add --no-hf")
    if final_only and long_prompt_len:
        raise ValueError("a late prompt arrives once every request is decoding, which only outputs every step show; "
                         "drop --final-only or --long-prompt-len")
    engine = Engine(args)
    prompt_len = shared_prefix_len + (input_len_max or input_len)
    if engine.model_config.is_encoder_decoder:  # prompts are encoder inputs; the decoder holds its start + outputs
        if max(prompt_len, long_prompt_len) > engine.model_config.max_encoder_len:
            raise ValueError(f"the workload's inputs have up to {max(prompt_len, long_prompt_len)} tokens but the "
                             f"encoder takes at most {engine.model_config.max_encoder_len}; shorten them")
        longest = 1 + output_len
    else:
        longest = max(prompt_len + output_len, long_prompt_len + 1)
    if longest > engine.max_model_len:
        raise ValueError(f"the workload needs {longest} tokens per request but max_model_len="
                         f"{engine.max_model_len}; shorten it")
    hf_model = load_transformers(engine) if with_transformers else None
    lengths = (f"ShareGPT-like lengths ({INPUT_MEDIAN} / {OUTPUT_MEDIAN} median input / output tokens)"
               if sharegpt_like else f"{input_len}{f'..{input_len_max}' if input_len_max else ''} input tokens")
    print(f"workload: {num_prompts} prompts x {lengths}"
          + (f" after a shared {shared_prefix_len}-token prefix" if shared_prefix_len else "")
          + ("" if sharegpt_like else f", {output_len} output tokens") + " ("
          + (f"beam search, width {sequences}" if beam_search else f"n={sequences} samples" if sequences > 1
             else "greedy") + ", ignore_eos)"
          + (f", one {long_prompt_len}-token prompt arriving mid-decode" if long_prompt_len else "")
          + f"; model {engine.model_name}, {str(engine.dtype).removeprefix('torch.')} on {engine.device}, "
          f"torch threads {torch.get_num_threads()}; median of {repeats} interleaved runs after a warm-up of "
          f"{min(num_prompts, 4)} prompts of {input_len} tokens")
    # seeds: runs use seed + repeat; the late prompt and the warm-up get seeds of their own (far apart:
    # random.Random treats -n like n)
    # warm-up on the workload's own prompt length: the kernels a prefill of that size needs (attention's prefill
    # tiles) compile here, not inside the first timed run
    run_engine(engine, random_prompts(engine, min(num_prompts, 4), input_len, seed=10**6), 4)
    ours_runs, hf_runs = [], []
    for repeat in range(repeats):  # interleaved, so a noisy spell on the machine hits both
        # fresh prompts each run, so no run reuses the prefix cache a previous one filled
        if sharegpt_like:
            prompt_lens, output_lens = sharegpt_like_lengths(num_prompts, args.seed + repeat)
            prompts = random_prompts(engine, num_prompts, 0, args.seed + repeat, lengths=prompt_lens)
        else:
            prompts = random_prompts(engine, num_prompts, input_len, args.seed + repeat, shared_prefix_len,
                                     input_len_max)
            output_lens = [output_len] * num_prompts
        late = random_prompts(engine, 1, long_prompt_len, 10**6 + 1 + repeat)[0] if long_prompt_len else None
        ours_runs.append(run_engine(engine, prompts, output_lens, late, sequences, beam_search, final_only))
        if hf_model is not None:
            hf_runs.append(run_transformers(hf_model, prompts, output_len, sequences, beam_search))
    ours = _median_run(ours_runs)
    stats = engine.stats()
    print(f"fasterllm     : {ours['requests_per_s']:8.2f} req/s {ours['output_tokens_per_s']:9.1f} output tok/s  "
          f"total {ours['seconds']:.2f} s  TTFT median {ours['ttft_median_ms']:.1f} ms (max {ours['ttft_max_ms']:.1f})"
          f"  TPOT median {ours['tpot_median_ms']:.2f} ms  ITL p50/p99/max {ours['itl_p50_ms']:.1f}/"
          f"{ours['itl_p99_ms']:.1f}/{ours['itl_max_ms']:.1f} ms")
    print(f"engine stats  : peak KV blocks {ours['peak_kv_blocks']}/{stats.num_kv_blocks}, preemptions "
          f"{stats.num_preemptions} (swaps out/in {stats.num_swapped_out}/{stats.num_swapped_in}), prefix cache "
          f"hit rate {stats.prefix_cache_hit_rate:.1%} ({stats.prefix_cache_hits}/{stats.prefix_cache_queries} "
          f"tokens), cached blocks {stats.num_cached_blocks}")
    results = {"fasterllm": ours}
    if engine.device.type == "cuda" and not engine.model_config.is_encoder_decoder:
        from fasterllm.bench.gpu_roofline import print_roofline

        results["roofline"] = print_roofline(engine, ours, sum(len(p) for p in prompts) + sum(output_lens))
    if hf_runs:
        hf = results["transformers"] = _median_run(hf_runs)
        print(f"transformers  : {hf['requests_per_s']:8.2f} req/s {hf['output_tokens_per_s']:9.1f} output tok/s  "
              f"TTFT {hf['ttft_ms']:8.1f} ms  TPOT {hf['tpot_ms']:6.2f} ms  (batched generate, sdpa)")
        print(f"ratio (output tok/s, fasterllm / transformers): {ours['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x")
    return results
