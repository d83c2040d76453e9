"""What the CPU decode-stack tests swap in for a model's cpu_decode_stack."""
from __future__ import annotations


class CountingStack:
    """The model's stack, counting the steps it runs."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def takes(self, *args) -> bool:
        return self.stack.takes(*args)

    def __call__(self, *args):
        self.calls += 1
        return self.stack(*args)
