"""Triton kernels: pure functions, each with a torch reference to test against."""
