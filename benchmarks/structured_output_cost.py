"""What a JSON-schema constraint costs per output token: the same 32 concurrent requests, all constrained by a JSON
schema, then all free, on the default SmolLM2 (or --model), interleaved runs, every request producing
--output-len tokens (the schema asks for a long array, the free requests ignore eos).

    python benchmarks/structured_output_cost.py [--model PATH [--load-format dummy]] [--device cpu|cuda] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from fasterllm import LLM, SamplingParams
from fasterllm.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "minItems": 500,
                                                     "items": {"type": "string", "maxLength": 12}}},
          "required": ["words"], "additionalProperties": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load-format", default="auto", help="dummy: random weights of --model's shape")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, max_model_len=512, load_format=args.load_format)
    prompts = [f"List {i + 10} words about the sea, as JSON." for i in range(args.num_requests)]
    runs = {
        "json schema": SamplingParams(temperature=0.8, seed=0, max_tokens=args.output_len,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        "free": SamplingParams(temperature=0.8, seed=0, max_tokens=args.output_len, ignore_eos=True),
    }
    first = time.perf_counter()
    llm.generate(prompts[:1], runs["json schema"], use_tqdm=False)  # the tokenizer's grammar tables, once
    print(f"first constrained request (grammar tokenizer setup + compile): {time.perf_counter() - first:.2f} s")
    per_token: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, params in runs.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            per_token[name].append((time.perf_counter() - start) / tokens * args.num_requests)
    for name, values in per_token.items():
        print(f"{name:12s}: {1e3 * statistics.median(values):.2f} ms per output token per request "
              f"(runs: {', '.join(f'{1e3 * v:.2f}' for v in values)})")
    ratio = statistics.median(per_token["json schema"]) / statistics.median(per_token["free"])
    print(f"constraint cost: {100 * (ratio - 1):+.1f}%")


if __name__ == "__main__":
    main()
