"""Pieces the Gluon one-row kernels share (int4_gemv.py, int8_gemv.py): waiting for the kernel before under
programmatic dependent launch, and the bf16 halves of int32 words."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def early_start(PDL: gl.constexpr):
    """dependent_launch.early_start in Gluon: wait for the kernel before (all its writes visible), then let the next
    kernel's programs start."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def bf16_of_pair(pairs, HIGH: gl.constexpr):
    """The low (or HIGH) bf16 of int32 pairs, as float32."""
    if HIGH:
        return (pairs & -65536).to(gl.float32, bitcast=True)
    return (pairs << 16).to(gl.float32, bitcast=True)
