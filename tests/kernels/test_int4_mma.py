"""The Gluon int4 tensor-core kernel for 1-64 rows (kernels/int4_mma.py). Triton's interpreter cannot run Gluon, so on
a CPU the facts the kernel stands on are replayed in torch: tinygemm's words hold, lane by lane, the mma B
fragments (which k each nibble pair is) and, two blocks together, the A fragments of W x^T, and the kernel's PTX
dequantization (magic, minus 136, scale and zero, bf16 roundings) gives the reference's weights; on a GPU the kernel
itself, every tile candidate, against tinygemm_reference and torch's kernel."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")
from int4_weights import int4_weight as weight_on  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gpu_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="the Gluon kernel runs on an NVIDIA GPU only")


def int4_weight(n, k, group_size):
    return weight_on(n, k, group_size, DEVICE)


def test_each_lanes_word_is_its_mma_b_fragments():
    """mma.sync m16n8k16's B fragment gives lane l the column n = l // 4 and the k pairs 2 (l % 4) + {0, 1} and that
    + 8 of its k tile of 16; the kernel takes nibbles i and i + 4 of lane l's word (l = 4 r + j of a block of 8 rows
    and a tile of 32 k) as the pair at k = 8 i + 2 j: fragment register i % 2 of k tile i // 2."""
    codes, packed, _, _ = int4_weight(16, 64, 32)
    words = packed.cpu().view(2, 2, 32)  # [block of 8 rows, tile of 32 k, lane]
    for block in range(2):
        for tile in range(2):
            for lane in range(32):
                word = int(words[block, tile, lane]) & 0xFFFFFFFF
                n = 8 * block + lane // 4
                for i in range(4):
                    k = 32 * tile + 16 * (i // 2) + 8 * (i % 2) + 2 * (lane % 4)
                    pair = ((word >> (4 * i)) & 0xF, (word >> (4 * i + 16)) & 0xF)
                    assert pair == (int(codes[n, k]), int(codes[n, k + 1])), (block, tile, lane, i)


def test_two_blocks_words_are_the_mma_a_fragments_of_a_16_row_tile():
    """W x^T (1-8 rows): mma.sync m16n8k16's A fragment gives lane l rows g = l // 4 and g + 8 of its 16-row tile and
    the k pairs 2 (l % 4) + {0, 1} (registers a0: row g, a1: row g + 8) and those + 8 (a2: row g, a3: row g + 8) of
    its k tile of 16; the kernel takes lane l's word of the tile's first block of 8 rows for a0 / a2 and of its
    second block for a1 / a3, nibble pair i of each for k tile i // 2, register i % 2 of the pair."""
    codes, packed, _, _ = int4_weight(32, 64, 32)
    words = packed.cpu().view(4, 2, 32)  # [block of 8 rows, tile of 32 k, lane]
    for tile16 in range(2):
        for k32 in range(2):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for k16 in range(2):
                    for register, (row, extra_k) in enumerate([(g, 0), (g + 8, 0), (g, 8), (g + 8, 8)]):
                        block = 2 * tile16 + (row >= 8)
                        word = int(words[block, k32, lane]) & 0xFFFFFFFF
                        i = 2 * k16 + register // 2  # the kernel's pair for this register
                        pair = ((word >> (4 * i)) & 0xF, (word >> (4 * i + 16)) & 0xF)
                        n, k = 16 * tile16 + row, 32 * k32 + 16 * k16 + extra_k + 2 * t
                        assert pair == (int(codes[n, k]), int(codes[n, k + 1])), (tile16, k32, lane, k16, register)


def bf16_of(bits: int) -> float:
    return float(torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16))


def rounded(value: torch.Tensor) -> torch.Tensor:
    """A float64 value rounded once to bf16, as fma.rn.bf16x2 rounds its exact result."""
    return value.to(torch.bfloat16).double()


def test_dequantization_replayed_gives_the_reference_weights():
    """The kernel's PTX (its shifts, lop3 mask and magic, the 1 and -136 of its first FMA) replayed in float64 on real
    words, with one bf16 rounding per FMA: each pair of weights equals the reference's weights at the k the first
    test names, rounded to bf16 (within one bf16 unit: the reference rounds in fp32 first). A wrong constant or
    shift is off by far more."""
    from fasterllm.kernels.int4_mma import _dequantize_asm

    asm = _dequantize_asm()
    mask, magic = (int(v, 16) for v in re.search(r"lop3\.b32 c, w, (0x[0-9A-F]+), (0x[0-9A-F]+), 0xEA", asm).groups())
    one = bf16_of(int(re.search(r"mov\.b32 one, (0x[0-9A-F]+)", asm).group(1), 16) & 0xFFFF)
    bias = bf16_of(int(re.search(r"mov\.b32 bias, (0x[0-9A-F]+)", asm).group(1), 16) & 0xFFFF)
    shifts = [0] + [int(v) for v in re.findall(r"shr\.u32 w, \$4, (\d+)", asm)]
    codes, packed, scale_zeros, weight = int4_weight(16, 64, 32)
    words = packed.cpu().view(2, 2, 32)
    scale_zeros, weight = scale_zeros.cpu().double(), weight.cpu().double()
    for block in range(2):
        for tile in range(2):
            for lane in range(32):
                n, word = 8 * block + lane // 4, int(words[block, tile, lane]) & 0xFFFFFFFF
                scale, zero = scale_zeros[tile, n]
                for i, shift in enumerate(shifts):
                    bits = ((word >> shift) & mask) | magic
                    k = 32 * tile + 16 * (i // 2) + 8 * (i % 2) + 2 * (lane % 4)
                    for half in range(2):
                        c = torch.tensor(bf16_of((bits >> (16 * half)) & 0xFFFF), dtype=torch.float64)
                        got = rounded(rounded(c * one + bias) * scale + zero)
                        expected = weight[n, k + half]
                        unit = 2.0 ** (torch.frexp(expected).exponent.item() - 8)  # one bf16 unit near it
                        assert abs(got - expected) <= unit, (block, tile, lane, i, half, float(got), float(expected))


def test_tiles_are_those_the_gpus_shared_memory_holds():
    """At 64 rows the largest candidate takes 104 KiB (groups of 32), more than a consumer Ampere or Ada GPU lets a
    program have (99 KiB): it is left out there, kept on a Hopper GPU (227 KiB); with too little for any, the
    smallest is taken."""
    from fasterllm.kernels.int4_mma import CANDIDATES, WEIGHT_A_CANDIDATES, shared_bytes, tiles_that_fit

    consumer, hopper = 99 * 1024, 227 * 1024
    largest = max(CANDIDATES, key=lambda tile: shared_bytes(tile, 64, 32))
    assert shared_bytes(largest, 64, 32) == 104 * 1024
    assert tiles_that_fit(hopper, 64, 32) == CANDIDATES
    assert tiles_that_fit(consumer, 64, 32) == [tile for tile in CANDIDATES if tile != largest]
    assert tiles_that_fit(consumer, 16, 32) == CANDIDATES
    assert tiles_that_fit(consumer, 16, 32, WEIGHT_A_CANDIDATES) == WEIGHT_A_CANDIDATES  # 1-8 rows: W x^T's own
    smallest = min(CANDIDATES, key=lambda tile: shared_bytes(tile, 64, 128))
    assert tiles_that_fit(1024, 64, 128) == [smallest]


@gpu_only
@pytest.mark.parametrize("m", [1, 5, 8, 16, 17, 33, 64])
@pytest.mark.parametrize("n, k, group_size", [(72, 576, 32), (64, 640, 128), (136, 768, 256), (4096, 14336, 32),
                                              (72, 576, 96)])
def test_int4_mma_every_tile_against_the_reference(n, k, group_size, m):
    """Partial column blocks (72, 136), tile counts that are not a multiple of a step's tiles (18-24), groups of
    32-256 and of 96 (a step of 2 or 4 tiles crosses a group's end), the down projection's K (split K), padding rows;
    bias or not; every form the GPU runs at m rows (1-8 rows W x^T; above, x W^T and, on Hopper, W x^T through wgmma,
    whose rows past M sit in a block of 16, 32 or 64)."""
    from fasterllm.kernels.int4_mma import FORMS, forms_for, int4_mma

    _, packed, scale_zeros, weight = int4_weight(n, k, group_size)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    for form in forms_for(m, DEVICE):
        for tile in FORMS[form].candidates:
            for b in (None, bias):
                expected = x.float() @ weight.t() + (0 if b is None else b.float())
                got = int4_mma(x, packed, scale_zeros, group_size, b, tile=tile, form=form)
                assert got.shape == (m, n) and got.dtype == torch.bfloat16
                torch.testing.assert_close(got.float(), expected, atol=1e-2 * expected.abs().max().item(), rtol=0,
                                           msg=lambda text: f"{form} {tile}: {text}")


def test_wgmma_only_where_the_gpu_has_it(monkeypatch):
    """9-64 rows go through wgmma on Hopper (sm_90) only: Ampere, Ada and Blackwell (sm_100, sm_120) have no wgmma
    and take x W^T; 1-8 rows are W x^T through mma.sync everywhere."""
    from fasterllm.kernels import int4_mma

    for capability, above_8 in [((9, 0), ["w_xt_wgmma", "x_wt"]), ((8, 0), ["x_wt"]), ((8, 9), ["x_wt"]),
                                ((10, 0), ["x_wt"]), ((12, 0), ["x_wt"]), (None, ["x_wt"])]:
        monkeypatch.setattr(int4_mma, "nvidia_capability", lambda device, capability=capability: capability)
        assert int4_mma.forms_for(8, DEVICE) == ["w_xt"]
        assert int4_mma.forms_for(9, DEVICE) == int4_mma.forms_for(64, DEVICE) == above_8, capability


@gpu_only
@pytest.mark.parametrize("m", [1, 16])
def test_int4_mma_agrees_with_torchs_kernel(m):
    from fasterllm.kernels.int4_mma import int4_mma

    _, packed, scale_zeros, _ = int4_weight(4096, 4096, 32)
    x = torch.randn(m, 4096, device=DEVICE).to(torch.bfloat16)
    theirs = torch._weight_int4pack_mm(x, packed, 32, scale_zeros).float()
    torch.testing.assert_close(int4_mma(x, packed, scale_zeros, 32).float(), theirs,
                               atol=1e-2 * theirs.abs().max().item(), rtol=0)


def test_int4_mma_refuses_what_it_cannot_read():
    from fasterllm.kernels.int4_mma import MAX_ROWS, int4_mma

    _, packed, scale_zeros, _ = int4_weight(16, 128, 32)
    with pytest.raises(ValueError, match="bf16 rows"):
        int4_mma(torch.randn(2, 128, device=DEVICE), packed, scale_zeros, 32)
    with pytest.raises(ValueError, match="bf16 rows"):
        int4_mma(torch.randn(MAX_ROWS + 1, 128, device=DEVICE).to(torch.bfloat16), packed, scale_zeros, 32)
    with pytest.raises(ValueError, match="bf16 rows"):
        int4_mma(torch.randn(2, 96, device=DEVICE).to(torch.bfloat16), packed, scale_zeros, 32)
    rows = torch.randn(16, 128, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="named with it"):  # a tile means nothing without its form
        int4_mma(rows, packed, scale_zeros, 32, tile=(2, 2, 4, 4, 4))
    with pytest.raises(ValueError, match="runs the forms"):  # mma.sync's W x^T multiplies 8 rows at most
        int4_mma(rows, packed, scale_zeros, 32, form="w_xt")
