"""Weight-only int8 / int4 matrix-vector products for decode's few rows (Triton): y = x @ dequant(W)^T.

A batch of 1-4 rows reads every weight once and does 2 flops per weight per row: the tensor cores have nothing
to do and the speed is the speed of streaming the weight bytes. So no tl.dot here (it pads the rows to 16):
each program owns BLOCK_N output columns and walks their rows of W (contiguous bytes along K) in chunks of
BLOCK_B bytes, widening them in registers, multiplying by the matching slice of x and summing along K. Every
output column is finished by one program: no split-K workspace, no second launch. The weight layouts are
quant_weight_only.py's (int8 [N, K] with a scale per row; int4 [N, K/2], k = 2j low nibble and 2j+1 high, an
fp16 scale and minimum per group of GROUP k): int4 groups are summed first and scaled once per group
(sum_k (q s + m) x = s sum_k q x + m sum_k x), so the scales are read per group, not per weight.

The best tile depends on the shape and the GPU, so the first call of each shape on a GPU times a few candidate
tiles (CUDA events, outside any graph capture) and keeps the fastest; the engine's warm-up before capturing
its decode graphs makes that first call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4
# (BLOCK_N, BLOCK_B weight bytes per row per step, num_warps): small BLOCK_N keeps thousands of programs
# streaming for 4096-wide outputs; larger chunks keep more bytes in flight per program
_CANDIDATES = [(1, 2048, 4), (2, 1024, 4), (2, 2048, 4), (4, 512, 4), (4, 1024, 4), (4, 1024, 8), (8, 512, 4),
               (8, 1024, 8), (16, 256, 4), (16, 512, 8)]
_DEFAULT = (4, 512, 4)  # the CPU interpreter and shapes timed nowhere
_chosen: dict[tuple, tuple[int, int, int]] = {}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_gn,
                 INT4: tl.constexpr, GROUP: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rows = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + rn.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if INT4:
        GROUPS: tl.constexpr = 2 * BLOCK_B // GROUP  # whole groups per chunk: BLOCK_B bytes = 2 * BLOCK_B k
        HALF: tl.constexpr = GROUP // 2  # bytes per group
        g = tl.arange(0, GROUPS)
        j = tl.arange(0, HALF)
        for b0 in range(0, K // 2, BLOCK_B):
            byte = b0 + g[:, None] * HALF + j[None, :]  # [GROUPS, HALF] byte index along the row
            k_mask = byte < K // 2
            if EVEN_K:
                packed = tl.load(w_rows[:, None, None] + byte[None, :, :], mask=n_mask[:, None, None],
                                 eviction_policy="evict_first")
            else:
                packed = tl.load(w_rows[:, None, None] + byte[None, :, :],
                                 mask=n_mask[:, None, None] & k_mask[None, :, :], other=0,
                                 eviction_policy="evict_first")
            low = (packed & 0xF).to(tl.float32)  # [BLOCK_N, GROUPS, HALF]: k = 2 * byte
            high = (packed >> 4).to(tl.float32)  # k = 2 * byte + 1
            group = b0 * 2 // GROUP + g
            g_mask = n_mask[:, None] & (group < K // GROUP)[None, :]
            g_offsets = rn[:, None].to(tl.int64) * stride_gn + group[None, :]
            scale = tl.load(scale_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)  # [BLOCK_N, GROUPS]
            minimum = tl.load(min_ptr + g_offsets, mask=g_mask, other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x_row = x_ptr + m * stride_xm + 2 * byte
                x_mask = k_mask & (tl.zeros_like(byte) + m < M)  # rows past M read zeros
                x_even = tl.load(x_row, mask=x_mask, other=0.0).to(tl.float32)  # [GROUPS, HALF]
                x_odd = tl.load(x_row + 1, mask=x_mask, other=0.0).to(tl.float32)
                codes_x = tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
                x_sum = tl.sum(x_even + x_odd, axis=1)  # [GROUPS]
                part = tl.sum(scale * codes_x + minimum * x_sum[None, :], axis=1)  # [BLOCK_N]
                acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    else:
        kk = tl.arange(0, BLOCK_B)
        for k0 in range(0, K, BLOCK_B):
            k = k0 + kk
            if EVEN_K:
                w = tl.load(w_rows[:, None] + k[None, :], mask=n_mask[:, None], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows[:, None] + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0,
                            eviction_policy="evict_first")
            w = w.to(tl.float32)  # int8 codes, or float weights (the unquantized comparison)
            for m in tl.static_range(BLOCK_M):
                x = tl.load(x_ptr + m * stride_xm + k, mask=(k < K) & (tl.zeros_like(k) + m < M),
                            other=0.0).to(tl.float32)
                part = tl.sum(w * x[None, :], axis=1)
                acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
        if HAS_SCALE:  # int8: one scale per row of W
            acc = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & n_mask[None, :]
    tl.store(out_ptr + rows[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_weight_only(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None,
                     minimums: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """x [M <= GEMV_MAX_ROWS, K] times the int8 (minimums None) or int4 weight -> [M, N] in x's dtype; with
    scales None, qweight is a float weight used as it is (the same kernel on bf16 weights, for comparison with
    cuBLAS). The caller (quant_weight_only.weight_only_matmul) has checked the shapes."""
    m, k = x.shape
    n = qweight.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"gemv_weight_only takes at most {GEMV_MAX_ROWS} rows, got {m}; use weight_only_matmul")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    int4 = minimums is not None

    def launch(config: tuple[int, int, int]) -> None:
        block_n, block_b, warps = config
        if int4:
            block_b = max(block_b, group_size // 2)  # whole groups per chunk
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, qweight, scales if scales is not None else out, minimums if int4 else out,
            bias if bias is not None else out, out, m, n, k,
            x.stride(0), qweight.stride(0), scales.stride(0) if int4 else 0, INT4=int4,
            GROUP=group_size if int4 else 1, HAS_SCALE=scales is not None, HAS_BIAS=bias is not None,
            EVEN_K=(k // 2 if int4 else k) % block_b == 0, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n,
            BLOCK_B=block_b, num_warps=warps)

    launch(_config_for((n, k, qweight.dtype, group_size, x.dtype, x.device), launch))  # timed at the first m seen
    return out


def _config_for(key: tuple, launch) -> tuple[int, int, int]:
    """The fastest candidate tile for this shape, timed on its first call on a GPU (not while a graph captures)."""
    if key in _chosen:
        return _chosen[key]
    device = key[-1]
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return _DEFAULT
    # decode reads W from HBM, not from L2: a buffer twice the L2 is written between runs
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8, device=device)
    timings = {}
    for config in _CANDIDATES:
        launch(config)  # compile
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
        for start, end in events:
            flush.zero_()
            start.record()
            launch(config)
            end.record()
        torch.cuda.synchronize(device)
        timings[config] = sorted(start.elapsed_time(end) for start, end in events)[len(events) // 2]
    _chosen[key] = min(timings, key=timings.get)
    return _chosen[key]


def chosen_tiles() -> dict[tuple, tuple[int, int, int]]:
    """(N, K, weight dtype, group, x dtype, device) -> the (BLOCK_N, BLOCK_B, num_warps) timed fastest so far."""
    return dict(_chosen)
