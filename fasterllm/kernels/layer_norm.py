"""Fused add-bias + residual + LayerNorm (Triton), one program per token row.

An encoder layer ends each half with LayerNorm(x W^T + b + residual). Unfused that is a GEMM with a bias
epilogue, an in-place add (reads two [T, H] tensors, writes one) and a LayerNorm (reads one, writes one);
here the GEMM runs without bias and this kernel reads the GEMM output and the residual once and writes the
normalised row once, in one launch. Sums and the normalisation are fp32; the result is rounded once to the
input dtype. The torch reference is add_bias_residual_layer_norm_reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start


@triton.jit
def _add_bias_residual_layer_norm_kernel(x_ptr, bias_ptr, residual_ptr, weight_ptr, norm_bias_ptr, out_ptr, eps,
                                         stride_x, stride_r, stride_out, HIDDEN: tl.constexpr,
                                         BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / HIDDEN
    centred = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    norm_bias = tl.load(norm_bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (centred * rstd * weight + norm_bias).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_bias_residual_layer_norm(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                                 weight: torch.Tensor, norm_bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x, residual [T, H]; bias (None: x has its bias already), weight, norm_bias [H] ->
    LayerNorm(x + bias + residual) * weight + norm_bias."""
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"x and residual must be [T, H] of one dtype; got x {tuple(x.shape)} {x.dtype}, "
                         f"residual {tuple(residual.shape)} {residual.dtype}")
    vectors = [t for t in (bias, weight, norm_bias) if t is not None]
    if any(t.shape != x.shape[1:] for t in vectors):
        raise ValueError(f"bias, weight and norm_bias must be [{x.shape[1]}]; got "
                         f"{', '.join(str(tuple(t.shape)) for t in vectors)}")
    if any(t.stride(-1) != 1 for t in (x, residual, *vectors)):
        raise ValueError("every input needs a contiguous last dim (stride 1)")
    num_tokens, hidden = x.shape
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _add_bias_residual_layer_norm_kernel[(num_tokens,)](
            x, weight if bias is None else bias, residual, weight, norm_bias, out, eps, x.stride(0), residual.stride(0),
            out.stride(0), HIDDEN=hidden, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4 if block <= 1024 else 8,
            **early_launch(x.device))
    return out


def add_bias_residual_layer_norm_reference(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                                           weight: torch.Tensor, norm_bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The same computation in torch, fp32 throughout, rounded once at the end (as the kernel)."""
    summed = x.float() + residual.float() + (0.0 if bias is None else bias.float())
    return F.layer_norm(summed, x.shape[1:], weight.float(), norm_bias.float(), eps).to(x.dtype)
