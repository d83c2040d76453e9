"""Dynamic per-token activation quantization (Triton), alone or fused into its neighbour (FasterLLaMA's W8A8).

Every token row gets one fp32 scale, absmax / QMAX, and its values become round(x * QMAX / absmax): int8
(QMAX 127, rounded half away from zero) or fp8 e4m3 (QMAX 448, the hardware's round to nearest). Three forms:
  quantize_per_token(x)                       x [T, H] -> (q, scales)
  silu_and_mul_quantize(gate_up)              [T, 2I] = [gate | up] -> quantize(silu(gate) * up)
  rms_norm_quantize(x, residual, weight, eps) -> (quantize(RMSNorm(x + residual) * weight), x + residual)
The float value each one quantizes is rounded to x's dtype first, exactly as the unfused layers produce it
(layers/activation.py, layers/norm.py), so the torch references below are the float layers plus
`quantize_per_token_reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.triton_target import compiled_for_gpu

# columns a program holds at once: a whole Llama-3-8B intermediate row (14336), read once and quantized from registers;
# wider rows loop twice (absmax, then quantize) in steps of this many (2048 a step took 11 us a row on an H100)
_CHUNK = 16384
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_MIN_ABSMAX = 1e-10  # an all-zero row gets a tiny scale and zeros, never a division by zero


@triton.jit
def _round_to_e4m3_grid(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic: the cast to fp8
    that follows is then exact everywhere (Triton 3.9's interpreter truncates instead of rounding)."""
    magnitude = tl.abs(v)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # below 2^-6 e4m3 is subnormal: a fixed step of 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2^(e-3), exact
    t = magnitude / step
    whole = tl.floor(t)
    rest = t - whole
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
    whole = tl.where((rest > 0.5) | ((rest == 0.5) & odd), whole + 1.0, whole)
    return tl.where(v < 0, -whole * step, whole * step)


@triton.jit
def to_quantized(v, inv_scale, QUANT_MAX: tl.constexpr, q_dtype: tl.constexpr, CAST_ROUNDS: tl.constexpr):
    """CAST_ROUNDS: the fp8 cast itself rounds to nearest even (compiled for a GPU: one instruction per pair); the
    interpreter's cast does not (ties, subnormals, the top of a binade), so there the value is put on the e4m3 grid
    first (some 20 fp32 operations)."""
    v = tl.minimum(tl.maximum(v * inv_scale, -QUANT_MAX), QUANT_MAX)
    if q_dtype == tl.int8:
        v = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))  # half away from zero on every backend
    elif not CAST_ROUNDS:
        v = _round_to_e4m3_grid(v)
    return v.to(q_dtype)


@triton.jit
def _row_values(x_row, cols, mask, WIDTH: tl.constexpr, SILU_MUL: tl.constexpr):
    """The float values to quantize at cols, as fp32 after rounding to x's dtype (as the float layers do)."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if SILU_MUL:
        up = tl.load(x_row + WIDTH + cols, mask=mask, other=0.0)
        g = x.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
        x = (silu * up.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, WIDTH: tl.constexpr, CHUNK: tl.constexpr,
                          SILU_MUL: tl.constexpr, QUANT_MAX: tl.constexpr, MIN_ABSMAX: tl.constexpr,
                          CAST_ROUNDS: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if WIDTH <= CHUNK:  # the whole row held at once: one read, the values kept for the second step
        cols = tl.arange(0, CHUNK)
        mask = cols < WIDTH
        v = _row_values(x_row, cols, mask, WIDTH, SILU_MUL)
        row_max = tl.maximum(tl.max(tl.abs(v), axis=0), MIN_ABSMAX)
        tl.store(scale_ptr + row, row_max / QUANT_MAX)
        tl.store(q_ptr + row * stride_q + cols,
                 to_quantized(v, QUANT_MAX / row_max, QUANT_MAX, q_ptr.dtype.element_ty, CAST_ROUNDS), mask=mask)
        return
    absmax = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, WIDTH, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        absmax = tl.maximum(absmax, tl.abs(_row_values(x_row, cols, cols < WIDTH, WIDTH, SILU_MUL)))
    row_max = tl.maximum(tl.max(absmax, axis=0), MIN_ABSMAX)
    tl.store(scale_ptr + row, row_max / QUANT_MAX)
    inv_scale = QUANT_MAX / row_max
    for start in range(0, WIDTH, CHUNK):  # the second read of the row comes from L2
        cols = start + tl.arange(0, CHUNK)
        mask = cols < WIDTH
        v = _row_values(x_row, cols, mask, WIDTH, SILU_MUL)
        tl.store(q_ptr + row * stride_q + cols,
                 to_quantized(v, inv_scale, QUANT_MAX, q_ptr.dtype.element_ty, CAST_ROUNDS), mask=mask)


@triton.jit
def _rms_norm_quantize_kernel(x_ptr, residual_ptr, weight_ptr, q_ptr, scale_ptr, new_residual_ptr, eps, stride_x,
                              stride_r, stride_q, stride_nr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                              ADD_RESIDUAL: tl.constexpr, QUANT_MAX: tl.constexpr, MIN_ABSMAX: tl.constexpr,
                              CAST_ROUNDS: tl.constexpr, PDL: tl.constexpr):
    early_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if ADD_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(dtype)  # the residual stream stays in the model dtype
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * weight).to(dtype).to(tl.float32)  # the float norm's output, never written to memory
    row_max = tl.maximum(tl.max(tl.abs(y), axis=0), MIN_ABSMAX)
    tl.store(scale_ptr + row, row_max / QUANT_MAX)
    tl.store(q_ptr + row * stride_q + cols,
             to_quantized(y, QUANT_MAX / row_max, QUANT_MAX, q_ptr.dtype.element_ty, CAST_ROUNDS), mask=mask)


def _warps(row_block: int) -> int:
    """Warps for a program holding row_block values of a row at once (16 warps from 4097 on)."""
    return 4 if row_block <= 1024 else 8 if row_block <= 4096 else 16


def _check_target(x: torch.Tensor, q_dtype: torch.dtype) -> None:
    if q_dtype not in QMAX:
        raise ValueError(f"q_dtype={q_dtype} is not a quantized activation type; use torch.int8 or "
                         "torch.float8_e4m3fn")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H] with a contiguous last dim, got {tuple(x.shape)} strides {x.stride()}")


def _quantize_rows(x: torch.Tensor, width: int, silu_mul: bool, q_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_target(x, q_dtype)
    num_tokens = x.shape[0]
    q = torch.empty(num_tokens, width, dtype=q_dtype, device=x.device)
    scales = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)  # [T, 1]: _scaled_mm's row-wise form
    if num_tokens:
        chunk = min(_CHUNK, triton.next_power_of_2(width))
        _quantize_rows_kernel[(num_tokens,)](x, q, scales, x.stride(0), q.stride(0), WIDTH=width,
                                             CHUNK=chunk, SILU_MUL=silu_mul, QUANT_MAX=QMAX[q_dtype],
                                             MIN_ABSMAX=_MIN_ABSMAX, CAST_ROUNDS=compiled_for_gpu(x),
                                             num_warps=_warps(chunk), **early_launch(x.device))
    return q, scales


def quantize_per_token(x: torch.Tensor, q_dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (q [T, H] of q_dtype, fp32 scales [T, 1]) with x ~= q * scales."""
    return _quantize_rows(x, x.shape[-1], False, q_dtype)


def silu_and_mul_quantize(gate_up: torch.Tensor, q_dtype: torch.dtype = torch.int8
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 2I] = [gate | up] -> quantize_per_token(silu(gate) * up) without writing the float product."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * intermediate], got {tuple(gate_up.shape)}")
    return _quantize_rows(gate_up, gate_up.shape[-1] // 2, True, q_dtype)


def rms_norm_quantize(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      q_dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scales, new residual): quantize_per_token(RMSNorm(x + residual) * weight) and x + residual (x itself
    when residual is None), in one pass."""
    _check_target(x, q_dtype)
    if weight.shape != x.shape[1:] or weight.dtype != x.dtype or weight.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} must be [H] of x's dtype, x is "
                         f"{tuple(x.shape)} {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    num_tokens, hidden = x.shape
    q = torch.empty(num_tokens, hidden, dtype=q_dtype, device=x.device)
    scales = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    new_residual = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _rms_norm_quantize_kernel[(num_tokens,)](
            x, x if residual is None else residual, weight, q, scales, new_residual, eps, x.stride(0),
            x.stride(0) if residual is None else residual.stride(0), q.stride(0), new_residual.stride(0),
            HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=residual is not None, QUANT_MAX=QMAX[q_dtype],
            MIN_ABSMAX=_MIN_ABSMAX, CAST_ROUNDS=compiled_for_gpu(x), num_warps=_warps(block),
            **early_launch(x.device))
    return q, scales, new_residual


def quantize_per_token_reference(x: torch.Tensor, q_dtype: torch.dtype = torch.int8
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of quantize_per_token (same formula, fp32)."""
    qmax = QMAX[q_dtype]
    v = x.float()
    absmax = v.abs().amax(dim=-1, keepdim=True).clamp_min(_MIN_ABSMAX)
    v = v * (qmax / absmax)
    if q_dtype == torch.int8:
        v = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(0.5 - v))
    return v.clamp(-qmax, qmax).to(q_dtype), absmax / qmax

