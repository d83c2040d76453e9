"""Matrix-vector products for batch-1 decode (Triton): y = x @ W^T, W float, int8, int4 or grouped 8-bit codes
(dequantized inside).

One row reads every weight once and does 2 flops per weight: the tensor cores have nothing to do and the speed
is the speed of streaming the weight bytes. So no tl.dot here (it pads the rows to 16): each program owns
BLOCK_N output columns and walks their rows of W (contiguous along K) in chunks of BLOCK_B weights (int4:
bytes), widening them in registers, multiplying by the matching slice of x and summing along K. Every output
column is finished by one program: no split-K workspace, no second launch. The weight layouts are
quant_weight_only.py's (int8 [N, K] with a scale per row; int4 [N, K/2], k = 2j low nibble and 2j+1 high, an
fp16 scale and minimum per group of GROUP k; grouped 8-bit [N, K], one code a byte, an fp32 or fp16 scale and
minimum per group): groups are summed first and scaled once per group (sum_k (q s + m) x = s sum_k q x + m sum_k x),
so the scales are read per group, not per weight. Codes become floats exactly by placing them under the bits of 2^23
(small_int_to_float); compiled for an NVIDIA GPU, one byte permute a code does it for int8 and 8-bit codes
(bytes_as_floats: 8B shape, H100, batch-1 int8 TPOT 3.39-3.41 -> 3.31 ms, benchmarks/RESULTS.md).

On Hopper and later the kernel is launched early (kernels/dependent_launch.py) and waits for the kernel before it
only once it starts. Fetching its weight rows into L2 before that wait did not pay (8B shape, batch 1, H100: TPOT
5.94-6.04 ms fetching whole rows, 5.69 ms the first chunk of each, 5.60-5.61 ms without; benchmarks/RESULTS.md).

The best tile depends on the shape and the GPU, so the first call of each shape on a GPU times a few candidate
tiles (kernels/tile_timer.py) and keeps the fastest; the engine's warm-up before capturing its decode graphs makes
that first call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasterllm.kernels.dependent_launch import early_launch, early_start
from fasterllm.kernels.one_shot_all_reduce import RankBuffers, push_for_next_call
from fasterllm.kernels.tile_timer import timed_tile
from fasterllm.kernels.triton_target import compiled_for_gpu

# (BLOCK_N, BLOCK_B weights per row per step (int4: bytes), num_warps): small BLOCK_N keeps thousands of programs
# streaming for 4096-wide outputs; larger chunks keep more bytes in flight per program
# (fused_moe.py's few-slot launches take the same tiles)
CANDIDATES = [(1, 2048, 4), (2, 1024, 4), (2, 2048, 4), (4, 512, 4), (4, 1024, 4), (4, 1024, 8), (8, 512, 4),
              (8, 1024, 8), (16, 256, 4), (16, 512, 8)]
DEFAULT = (4, 512, 4)  # the CPU interpreter and shapes timed nowhere


@triton.jit
def small_int_to_float(u, offset: tl.constexpr):
    """int32 u in [0, 2^23) -> float32 u - offset, exactly, without an int-to-float conversion instruction (a
    fraction of the FMA rate on NVIDIA GPUs, and the bottleneck of widening weights at HBM speed): 2^23 + u
    has u as its mantissa bits, so OR-ing u into the bits of 2^23 and subtracting 2^23 + offset is exact."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def bytes_as_floats(codes, SIGNED: tl.constexpr):
    """int8 (SIGNED) or uint8 codes -> float32 2^23 + code (+ 128 for int8), exactly, in inline PTX: one byte permute
    (prmt) places each code's byte under the bits of 2^23, and one xor per four int8 codes flips their sign bits
    (code + 128), where widening, offsetting and OR-ing (small_int_to_float) take three instructions a code. Compiled
    kernels on NVIDIA GPUs only (not Triton's interpreter)."""
    if SIGNED:
        return tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t, m; xor.b32 t, $4, 0x80808080; mov.b32 m, 0x4B000000;
            prmt.b32 $0, t, m, 0x7540; prmt.b32 $1, t, m, 0x7541; prmt.b32 $2, t, m, 0x7542;
            prmt.b32 $3, t, m, 0x7543; }""",
            constraints="=r,=r,=r,=r,r", args=[codes], dtype=tl.float32, is_pure=True, pack=4)
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 m; mov.b32 m, 0x4B000000;
        prmt.b32 $0, $4, m, 0x7540; prmt.b32 $1, $4, m, 0x7541; prmt.b32 $2, $4, m, 0x7542;
        prmt.b32 $3, $4, m, 0x7543; }""",
        constraints="=r,=r,=r,=r,r", args=[codes], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def load_weight_chunk(w_rows, n_mask, k0, K, BLOCK_B: tl.constexpr, EVEN_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_B of the float, int8 or e4m3 weight rows (masked lanes 0.0: an integer 0 cannot be
    cast to e4m3). Weights only: no kernel writes them, so the first chunk's may be read before early_start
    (tests/kernels/test_dependent_launch.py allows this function there)."""
    k = k0 + tl.arange(0, BLOCK_B)
    w_mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & (k < K)[None, :]
    return tl.load(w_rows[:, None] + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def add_chunk_product(acc, w, x_ptr, k0, K, BLOCK_B: tl.constexpr, HAS_SCALE: tl.constexpr, PRMT: tl.constexpr):
    """acc plus the weight chunk w (float, or int8 codes: HAS_SCALE) times x's columns k0 .. k0 + BLOCK_B."""
    k = k0 + tl.arange(0, BLOCK_B)
    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    if HAS_SCALE and PRMT:  # int8 codes
        w = bytes_as_floats(w, True) - (8388608.0 + 128.0)
    elif HAS_SCALE:
        w = small_int_to_float(w.to(tl.int32) + 128, 128)
    return acc + tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, buffers_ptr, epochs_ptr, N, K, stride_wn,
                 stride_gn, GROUPED_BITS: tl.constexpr, GROUP: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                 PUSH: tl.constexpr, ROWS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, PRMT: tl.constexpr,
                 PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if GROUPED_BITS == 0 and not HAS_SCALE:  # float weights, which no kernel writes: the first chunk's load is in
        w = load_weight_chunk(w_rows, n_mask, 0, K, BLOCK_B, EVEN_K)  # flight before waiting (int8's lost: RESULTS.md)
    early_start(PDL)
    if GROUPED_BITS == 4:
        GROUPS: tl.constexpr = 2 * BLOCK_B // GROUP  # whole groups per chunk: BLOCK_B bytes = 2 * BLOCK_B k
        HALF: tl.constexpr = GROUP // 2  # bytes per group
        g = tl.arange(0, GROUPS)
        for b0 in range(0, K // 2, BLOCK_B):
            byte = b0 + g[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [GROUPS, HALF] along the row
            k_mask = byte < K // 2
            w_mask = n_mask[:, None, None] if EVEN_K else n_mask[:, None, None] & k_mask[None, :, :]
            packed = tl.load(w_rows[:, None, None] + byte[None, :, :], mask=w_mask, other=0,
                             eviction_policy="evict_first")
            x_even = tl.load(x_ptr + 2 * byte, mask=k_mask, other=0.0).to(tl.float32)  # k = 2 * byte
            x_odd = tl.load(x_ptr + 2 * byte + 1, mask=k_mask, other=0.0).to(tl.float32)
            packed = packed.to(tl.int32)
            codes_x = tl.sum(small_int_to_float(packed & 0xF, 0) * x_even[None, :, :]
                             + small_int_to_float(packed >> 4, 0) * x_odd[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
            group = b0 * 2 // GROUP + g
            g_mask = n_mask[:, None] & (group < K // GROUP)[None, :]
            g_offsets = rn[:, None].to(tl.int64) * stride_gn + group[None, :]
            scale = tl.load(scale_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
            minimum = tl.load(min_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
            acc += tl.sum(scale * codes_x + minimum * tl.sum(x_even + x_odd, axis=1)[None, :], axis=1)
    elif GROUPED_BITS == 8:
        GROUPS_8: tl.constexpr = BLOCK_B // GROUP  # whole groups per chunk of BLOCK_B bytes (= k)
        g8 = tl.arange(0, GROUPS_8)
        for k0 in range(0, K, BLOCK_B):
            kk = k0 + g8[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP] along the row
            k_mask = kk < K
            w_mask = n_mask[:, None, None] if EVEN_K else n_mask[:, None, None] & k_mask[None, :, :]
            codes = tl.load(w_rows[:, None, None] + kk[None, :, :], mask=w_mask, other=0,
                            eviction_policy="evict_first")
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            if PRMT:
                values = bytes_as_floats(codes, False) - 8388608.0
            else:
                values = small_int_to_float(codes.to(tl.int32), 0)
            codes_x = tl.sum(values * x[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
            group = k0 // GROUP + g8
            g_mask = n_mask[:, None] & (group < K // GROUP)[None, :]
            g_offsets = rn[:, None].to(tl.int64) * stride_gn + group[None, :]
            scale = tl.load(scale_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
            minimum = tl.load(min_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
            acc += tl.sum(scale * codes_x + minimum * tl.sum(x, axis=1)[None, :], axis=1)
    else:
        if not HAS_SCALE:
            acc = add_chunk_product(acc, w, x_ptr, 0, K, BLOCK_B, HAS_SCALE, PRMT)
        for k0 in range(0 if HAS_SCALE else BLOCK_B, K, BLOCK_B):
            w = load_weight_chunk(w_rows, n_mask, k0, K, BLOCK_B, EVEN_K)
            acc = add_chunk_product(acc, w, x_ptr, k0, K, BLOCK_B, HAS_SCALE, PRMT)
        if HAS_SCALE:  # int8: one scale per row of W
            acc = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if PUSH:  # the row goes to the all-reduce's slot in every rank's buffer, not to out
        push_for_next_call(acc.to(out_ptr.dtype.element_ty), rn, n_mask, buffers_ptr, epochs_ptr, 0, N, ROWS, RANK,
                           WORLD)
    else:
        tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
         minimums: torch.Tensor | None = None, group_size: int = 0, code_bits: int = 4,
         push_to: RankBuffers | None = None) -> torch.Tensor | None:
    """One row x [1, K] (contiguous) times W^T -> [1, N] in x's dtype. W is a float weight [N, K] used as it is
    (scales None), int8 codes [N, K] with a scale per row, or grouped codes with per-group scales and minimums:
    int4 bytes [N, K/2] (code_bits 4) or uint8 codes [N, K] (code_bits 8) (quant_weight_only.py's layouts).
    push_to: a row-parallel layer's partial row goes straight into the fused all-reduce's buffers
    (kernels/one_shot_all_reduce.py, whose launch must come next, with x None), and None is returned."""
    k = x.shape[-1]
    n = weight.shape[0]
    grouped_bits = code_bits if minimums is not None else 0
    per_byte = 2 if grouped_bits == 4 else 1
    if x.numel() != k or weight.shape[1] * per_byte != k:
        raise ValueError(f"gemv takes one row of K values and a [N, K] weight, got x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)}")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    prmt = compiled_for_gpu(x) and torch.version.hip is None  # bytes_as_floats' PTX: NVIDIA GPUs

    def launch(config: tuple[int, int, int], push: RankBuffers | None = None) -> None:
        block_n, block_b, warps = config
        if grouped_bits:
            block_b = max(block_b, group_size // per_byte)  # whole groups per chunk
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, weight, scales if scales is not None else out, minimums if grouped_bits else out,
            bias if bias is not None else out, out, out if push is None else push.buffers,
            out if push is None else push.epochs, n, k, weight.stride(0), scales.stride(0) if grouped_bits else 0,
            GROUPED_BITS=grouped_bits, GROUP=group_size if grouped_bits else 1, HAS_SCALE=scales is not None,
            HAS_BIAS=bias is not None, EVEN_K=(k // per_byte) % block_b == 0, BLOCK_N=block_n, BLOCK_B=block_b,
            PUSH=push is not None, ROWS=1 if push is None else push.epochs.shape[0],
            RANK=0 if push is None else push.rank, WORLD=1 if push is None else push.world, PRMT=prmt,
            num_warps=warps, **early_launch(x.device))

    # the tile is timed writing out, never pushing: a timed push would fill a slot no all-reduce empties
    launch(timed_tile((n, k, weight.dtype, group_size, grouped_bits, x.dtype, x.device), launch, CANDIDATES,
                      DEFAULT), push_to)
    return out if push_to is None else None
