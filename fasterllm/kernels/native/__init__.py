"""Kernels that need more than Triton (DESIGN.md, "Kernels that need more than Triton"), each beside the torch
reference CI tests it against and with a fallback: cpu_gemv (C++ AVX2 / AVX-512 matrix-vector products of the int4
and int8 CPU layers for decode rows)."""
