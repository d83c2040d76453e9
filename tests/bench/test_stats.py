"""The percentile both benchmarks report (offline ITL, online TTFT/ITL)."""
import math
import random

from fasterllm.bench.stats import percentile


def test_percentile_is_the_value_at_that_rank_of_the_sorted_values():
    values = [float(v) for v in range(1, 11)]
    random.Random(0).shuffle(values)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 6.0  # rank 5 of 10: the upper median, as the benchmarks have always printed
    assert percentile(values, 99) == 10.0
    assert percentile(values, 100) == 10.0  # clamped to the largest
    assert math.isnan(percentile([], 50))
