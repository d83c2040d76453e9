"""Summary statistics the benchmarks print."""
from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) as the value at rank int(q% of n) of the sorted values (nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
