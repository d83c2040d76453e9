"""Workload (e): prompt and output lengths shaped like ShareGPT conversations, drawn from a fixed distribution (no
dataset download), so `fasterllm bench --sharegpt-like` and benchmarks/peers/vllm_bench.py draw the same requests.

Both lengths are log-normal with long tails, as ShareGPT's are: prompts of median 200 tokens (sigma 0.9, clipped to
4..1024), outputs of median 150 (sigma 0.8, clipped to 4..512); the tokens are random_prompts'.
"""
from __future__ import annotations

import math
import random

INPUT_MEDIAN, INPUT_SIGMA, INPUT_MAX = 200, 0.9, 1024
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MAX = 150, 0.8, 512
MIN_LEN = 4


def sharegpt_like_lengths(num_prompts: int, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, output lengths) of num_prompts requests."""
    rng = random.Random(seed)

    def draw(median: int, sigma: float, longest: int) -> int:
        return min(longest, max(MIN_LEN, round(rng.lognormvariate(math.log(median), sigma))))

    pairs = [(draw(INPUT_MEDIAN, INPUT_SIGMA, INPUT_MAX), draw(OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MAX))
             for _ in range(num_prompts)]
    return [p for p, _ in pairs], [o for _, o in pairs]
