"""Our C++ CPU extension (cpu/*.cpp: the int4 / int8 / uint8_grouped matrix products of cpu_gemv.py, the fused
add + RMSNorm of cpu_rms_norm.py): which ISA it runs, and building and loading it.

They run by default (FASTERLLM_CPU_KERNELS unset or "auto"), the ISA chosen from the CPU's flags ("avx512":
avx512f, else "avx2": avx2/fma/f16c); "avx512" or "avx2" forces one (tests and benchmarks run the AVX2 code on an
AVX-512 machine so); "off" keeps torch's kernels. They multiply the inputs as they come, in fp32, so a layer's output
is the exact product of its quantized weights up to fp32 summation: on SmolLM2 closer to the float model than
torch's kernels, which round inputs and outputs to bf16, and SmolLM2's single-stream decode 1.16-1.54x faster with
int4 / gguf / int8 on a quiet machine, AVX-512 and AVX2 alike (benchmarks/RESULTS.md, "The C++ CPU kernels in fp32"
and the seventh session's section).

The extension builds with torch.utils.cpp_extension on first use (scripts/setup.sh builds it when a compiler is
present, ~20 s on 2 cores) into torch's extension cache, which rebuilds when a source changes. Without a compiler,
or if the build fails, one warning line says so and the layers keep torch's kernels and ops.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from fasterllm.cpu_features import cpu_flags

logger = logging.getLogger("fasterllm")

ISA_ENV = "FASTERLLM_CPU_KERNELS"
ISA_FLAGS = {"avx512": {"avx512f", "avx2", "fma", "f16c"},
             "avx2": {"avx2", "fma", "f16c"}}
SOURCES = ("ops.cpp", "argmax_rows.cpp", "widen_rows.cpp", "quantize_rows.cpp", "gemv_avx2.cpp", "gemv_avx512.cpp",
           "rms_norm.cpp", "decode_attention.cpp", "rotary_store.cpp", "decode_stack.cpp", "seq2seq_decode_stack.cpp")


def supported_isas() -> list[str]:
    """The ISAs of these kernels that this CPU runs, widest first."""
    flags = cpu_flags()
    return [isa for isa, needs in ISA_FLAGS.items() if needs <= flags]


@functools.cache
def kernel_isa() -> str | None:
    """The ISA the layers run ("avx512" or "avx2"), or None: FASTERLLM_CPU_KERNELS "off", or unset / "auto" on a CPU
    with neither."""
    supported = supported_isas()
    asked = os.environ.get(ISA_ENV, "").strip().lower()
    if asked == "off":
        return None
    if asked in ("", "auto"):
        return supported[0] if supported else None
    if asked not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={asked!r} is not one of 'auto', 'avx512', 'avx2', 'off'; 'auto' chooses by the "
                         "CPU's flags (as unset does), 'off' runs torch's kernels")
    if asked not in supported:
        missing = sorted(ISA_FLAGS[asked] - cpu_flags())
        raise ValueError(f"{ISA_ENV}={asked!r}, but this CPU lacks {', '.join(missing)}; use one of "
                         f"{supported + ['off']} or unset it")
    return asked


@functools.cache
def load() -> bool:
    """Build (first time) and load the extension; False, after one warning line, where that fails."""
    from torch.utils import cpp_extension

    source_dir = Path(__file__).parent / "cpu"
    try:
        # -fopenmp: at::parallel_for is OpenMP inside ATen's headers (torch's own libgomp at run time); without it
        # the output rows would run on one thread
        cpp_extension.load("fasterllm_cpu_kernels", [str(source_dir / name) for name in SOURCES],
                           extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False,
                           verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: torch's kernels still run
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1])[:200]
        logger.warning("fasterllm's C++ CPU kernels could not be built (%s); the int4/int8 layers and RMSNorm use "
                       "torch's slower kernels: install a C++ compiler (g++) and ninja for them", reason)
        return False
    return True


def available() -> bool:
    """Whether the layers can run our kernels here: a CPU with one of the ISAs, and the extension built."""
    return kernel_isa() is not None and load()


