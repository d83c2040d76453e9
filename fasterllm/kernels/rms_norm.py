"""RMSNorm, fused residual-add + RMSNorm, and norm + residual-add + norm (Triton), one program per token row.

Rounding follows fasterllm.layers.norm.RMSNorm (the reference) step by step, so bf16 results agree bit
for bit except where fp32 sums in another order land on the other side of a bf16 rounding boundary:
  new_residual = round(x + residual);  y = round(round(rms_normalise_fp32(new_residual)) * weight).
Sandwich norms (Gemma 2 / 3) norm a sublayer's output before adding it to the residual stream, then norm the sum for
the next sublayer: x is first replaced by round(round(rms_normalise_fp32(x)) * first_weight), in the same launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, first_weight_ptr, weight_ptr, y_ptr, new_residual_ptr, first_eps, eps,
                     stride_x, stride_r, stride_y, stride_nr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                     ADD_RESIDUAL: tl.constexpr, NORM_FIRST: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if NORM_FIRST:  # the sublayer's output through its own norm first, rounded as a separate call would
        x = x.to(tl.float32)
        first_rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + first_eps)
        first_normed = (x * first_rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        first_weight = tl.load(first_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # through memory (y's row, overwritten below), as the separate call's output goes: kept in registers, the
        # new residual differed from the two calls' on an H100 (fp16: 801 of 2,880 elements; bf16 too; cause not
        # found; the interpreter agreed); through memory it is equal there, bf16 and fp16
        tl.store(y_ptr + row * stride_y + cols, (first_normed * first_weight).to(y_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()
        x = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(y_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    normed = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)  # rounded before the weight, as the reference
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (normed * weight).to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            first: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    for w in (weight,) if first is None else (weight, first[0]):
        if x.dim() != 2 or w.shape != x.shape[1:] or w.dtype != x.dtype:
            raise ValueError(f"x must be [T, H] and weight [H] of x's dtype; got x {tuple(x.shape)} {x.dtype}, "
                             f"weight {tuple(w.shape)} {w.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if any(t is not None and t.stride(-1) != 1 for t in (x, residual, weight)):
        raise ValueError("x, residual and weight need a contiguous hidden dim (stride 1)")
    num_tokens, hidden = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = None if residual is None else torch.empty_like(y)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        first_weight, first_eps = (weight, eps) if first is None else first
        _rms_norm_kernel[(num_tokens,)](
            x, x if residual is None else residual, first_weight, weight, y,
            y if new_residual is None else new_residual, first_eps, eps,
            x.stride(0), x.stride(0) if residual is None else residual.stride(0), y.stride(0), y.stride(0),
            HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=residual is not None, NORM_FIRST=first is not None,
            num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16, **early_launch(x.device))
    return y, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> RMSNorm(x) * weight, [T, H] in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual): the norm's output and the new residual stream."""
    y, new_residual = _launch(x, residual, weight, eps)
    return y, new_residual


def norm_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, first_weight: torch.Tensor, first_eps: float,
                      weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sandwich norms in one launch: (RMSNorm(a + residual) * weight, a + residual) with
    a = RMSNorm(x) * first_weight, each step rounded as the separate calls round it."""
    return _launch(x, residual, weight, eps, (first_weight, first_eps))
