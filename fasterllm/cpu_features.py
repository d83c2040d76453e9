"""What this CPU runs well, asked once at start-up; every CPU kernel choice reads it from here.

torch answers first, as it dispatches: the vector ISA of its own kernels (`torch.backends.cpu.get_cpu_capability()`,
which honours ATEN_CPU_CAPABILITY) and whether oneDNN has bf16 kernels (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`,
which honours ONEDNN_MAX_CPU_ISA: oneDNN needs avx512bw/vl/dq or avx_ne_convert). /proc/cpuinfo's flags answer
what torch does not: the bf16 dot-product instructions (avx512_bf16, amx_bf16) that make bf16 math pay.

AVX2_ONLY_ENV makes an AVX-512 machine answer, and run torch's, oneDNN's and MKL's code, as an AVX2-only one: the
tests and benchmarks/RESULTS.md use it (our C++ kernels take FASTERLLM_CPU_KERNELS=avx2 for their AVX2 code).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

AVX2_ONLY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@dataclass(frozen=True)
class CPUFeatures:
    kernel_isa: str  # torch's dispatch level: "AVX512", "AVX2", "DEFAULT", ...
    onednn_bf16: bool  # oneDNN packs and multiplies bf16 weights
    bf16_dot_product: bool  # avx512_bf16 / amx_bf16 flags: bf16 math in hardware
    exact_int8_matmul: bool  # torch._int_mm's int32 sums are exact (oneDNN has VNNI or AMX here)

    @property
    def native_bf16(self) -> bool:
        """bf16 halves a decode step's bytes and its math runs in hardware: the CPU's default dtype."""
        return self.onednn_bf16 and self.bf16_dot_product and self.kernel_isa.startswith("AVX512")

    def describe(self) -> str:
        yes = {True: "yes", False: "no"}
        return (f"torch kernels {self.kernel_isa}, oneDNN bf16 {yes[self.onednn_bf16]}, bf16 dot products "
                f"{yes[self.bf16_dot_product]}, exact int8 matmul {yes[self.exact_int8_matmul]}")


@functools.cache
def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo's first processor (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _int8_matmul_is_exact() -> bool:
    """Whether torch._int_mm sums int8 products exactly here. Without VNNI oneDNN may shift one operand to u8 and add
    pairs of u8 x s8 products in int16, which saturates: 127 x 127 rows came out tens of thousands off (torch 2.13, an
    AVX-512 machine capped to AVX2), while an AVX2-only Zen 3 summed them exactly. Asked once with such rows rather
    than read from flags, since neither the flags nor ONEDNN_MAX_CPU_ISA tell which kernel oneDNN runs."""
    a = torch.full((1, 64), 127, dtype=torch.int8)
    b = torch.full((64, 8), -127, dtype=torch.int8)
    try:
        return bool((torch._int_mm(a, b) == -64 * 127 * 127).all())
    except RuntimeError:  # a build without a CPU _int_mm
        return False


def detect_cpu_features() -> CPUFeatures:
    onednn = torch.backends.mkldnn.is_available()
    return CPUFeatures(kernel_isa=torch.backends.cpu.get_cpu_capability(),
                       onednn_bf16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                       bf16_dot_product=bool(cpu_flags() & {"avx512_bf16", "amx_bf16"}),
                       exact_int8_matmul=_int8_matmul_is_exact())


_detected: CPUFeatures | None = None  # asked once, on first use (tests may set another answer)


def cpu_features() -> CPUFeatures:
    global _detected
    if _detected is None:
        _detected = detect_cpu_features()
    return _detected


def bf16_path_note(dtype: torch.dtype) -> str | None:
    """One line saying how bf16 runs on this CPU and why, when it is not the native path (None otherwise)."""
    if dtype != torch.bfloat16:
        return None
    features = cpu_features()
    if not features.onednn_bf16:
        return ("bf16 on a CPU without oneDNN bf16 kernels (they need avx512bw/vl/dq or avx_ne_convert; "
                f"{features.describe()}): linear weights stay unpacked and run through torch's bf16 matmul")
    if not features.bf16_dot_product:
        return ("bf16 on a CPU without bf16 dot-product instructions (avx512_bf16 / amx_bf16; "
                f"{features.describe()}): oneDNN's packed bf16 linears convert to fp32 inside")
    return None
