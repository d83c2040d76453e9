"""Workload (e)'s lengths: the same requests for the same seed (both engines draw them), within their bounds, with
the long tails that make the workload mixed."""
from fasterllm.bench.sharegpt_like import INPUT_MAX, MIN_LEN, OUTPUT_MAX, sharegpt_like_lengths


def test_lengths_are_fixed_by_the_seed_bounded_and_mixed():
    prompts, outputs = sharegpt_like_lengths(1000, seed=0)
    assert (prompts, outputs) == sharegpt_like_lengths(1000, seed=0)
    assert sharegpt_like_lengths(1000, seed=1) != (prompts, outputs)
    assert all(MIN_LEN <= n <= INPUT_MAX for n in prompts) and all(MIN_LEN <= n <= OUTPUT_MAX for n in outputs)
    assert max(prompts) == INPUT_MAX and min(prompts) < 50  # a long tail both ways
    assert 150 <= sorted(prompts)[500] <= 250 and 110 <= sorted(outputs)[500] <= 190
