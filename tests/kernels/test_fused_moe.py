"""The fused MoE kernels against the torch expert loop (layers/moe.py): in Triton's interpreter on a CPU, natively on
a GPU. Loads are uneven on purpose: a busy expert over several row tiles, experts with one token, experts with none."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.activation import GeluAndMul, SiluAndMul
from fasterllm.layers.moe import route, run_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.fused_moe import (  # noqa: E402
    ROW_SLOTS, SMALL_TILES, TILE_CONFIGS, UNGROUPED_SLOTS, fused_experts, tile_config)
from fasterllm.kernels.moe_align import align_by_expert  # noqa: E402


def uneven_experts(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """[T, k] choices: expert 0 takes 30 tokens (two 16-row tiles), expert 1 the next 6, expert 2 one token; with
    k = 2 the second choices spread over experts 3-5, one token's to expert 6; the last expert gets none. k = E:
    every expert every token."""
    tokens = torch.arange(num_tokens)
    if top_k == num_experts:
        return torch.arange(num_experts).repeat(num_tokens, 1)
    first = torch.where(tokens < 30, 0, torch.where(tokens < 36, 1, 2))
    if top_k == 1:
        return first[:, None]
    second = 3 + tokens % 3
    second[0] = 6
    return torch.stack([first, second], dim=1)


def moe_inputs(num_tokens, num_experts, hidden, inter, top_k, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=generator) / inter ** 0.5
    weights = torch.rand(num_tokens, top_k, generator=generator) + 0.1
    weights /= weights.sum(dim=1, keepdim=True)
    experts = uneven_experts(num_tokens, num_experts, top_k)
    return [t.to(DEVICE, dtype) for t in (x, w_gate_up, w_down, weights)] + [experts.to(DEVICE)]


@pytest.mark.parametrize("top_k, num_experts", [(1, 4), (2, 8), (8, 8)])
@pytest.mark.parametrize("act", [SiluAndMul(), GeluAndMul("tanh"), GeluAndMul("none")], ids=lambda a: a.name)
def test_fused_experts_match_the_torch_loop(top_k, num_experts, act):
    x, w_gate_up, w_down, weights, experts = moe_inputs(37, num_experts, 48, 40, top_k)
    expected = run_experts(x, w_gate_up, w_down, weights, experts, act)
    got = fused_experts(x, w_gate_up, w_down, weights, experts, act.name)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("config", [*(config for _, config in TILE_CONFIGS), SMALL_TILES], ids=str)
def test_every_tile_shape_matches_the_torch_loop(config):
    x, w_gate_up, w_down, weights, experts = moe_inputs(37, 8, 48, 40, 2)
    expected = run_experts(x, w_gate_up, w_down, weights, experts, SiluAndMul())
    got = fused_experts(x, w_gate_up, w_down, weights, experts, "silu", config)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_groups_of_tiles_over_several_column_blocks_match_the_torch_loop():
    # 16-row tiles: 242 slots fill 19 of 23 (two groups of GROUP_M = 8, a part group of 7 with 3 real); 64 columns
    # a block: gate/up's 160 columns in 3 blocks, down's 96 in 2, so each program must find its tile and block
    x, w_gate_up, w_down, weights, experts = moe_inputs(121, 8, 96, 160, 2)
    expected = run_experts(x, w_gate_up, w_down, weights, experts, SiluAndMul())
    got = fused_experts(x, w_gate_up, w_down, weights, experts, "silu", SMALL_TILES)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("num_tokens", [1, 2, 4])
def test_a_few_tokens_run_as_matrix_vector_products_or_a_tile_per_slot(num_tokens):
    # top 8 of 8 experts: every expert is read once per token; 1-2 tokens through the matrix-vector launches, 4 tokens
    # ungrouped, each slot from its own tile
    assert 2 * 8 <= ROW_SLOTS < 4 * 8 <= UNGROUPED_SLOTS
    x, w_gate_up, w_down, weights, experts = moe_inputs(num_tokens, 8, 48, 40, 8)
    expected = run_experts(x, w_gate_up, w_down, weights, experts, SiluAndMul())
    got = fused_experts(x, w_gate_up, w_down, weights, experts, "silu")
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("num_tokens, hidden, inter, top_k", [(1, 48, 40, 2), (37, 48, 40, 2), (1, 16, 512, 8)])
def test_the_sums_start_at_zero_whatever_their_buffer_held(monkeypatch, num_tokens, hidden, inter, top_k):
    """The down launch adds into fp32 sums that the gate/up launch zeroes (no memset of its own): fresh buffers full
    of NaN change nothing, also where the sums are fewer than the launch's programs (the last case)."""
    x, w_gate_up, w_down, weights, experts = moe_inputs(num_tokens, 8, hidden, inter, top_k)
    expected = run_experts(x, w_gate_up, w_down, weights, experts, SiluAndMul())
    empty = torch.empty

    def nan_filled(*shape, **kwargs):
        buffer = empty(*shape, **kwargs)
        return buffer.fill_(float("nan")) if buffer.is_floating_point() else buffer

    monkeypatch.setattr(torch, "empty", nan_filled)
    config = tile_config(num_tokens * top_k, 8)  # the tiles' launches, also for the few-slot cases
    got = fused_experts(x, w_gate_up, w_down, weights, experts, "silu", config)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def runs_of(slots: torch.Tensor, tile_experts: torch.Tensor, block_m: int, num_experts: int) -> dict[int, list]:
    """Each expert's slots over its tiles (a run's order is not set: sorted), padding last."""
    runs: dict[int, list] = {}
    for tile, expert in enumerate(tile_experts.tolist()):
        if expert < num_experts:
            runs.setdefault(expert, []).extend(slots[tile * block_m:(tile + 1) * block_m].tolist())
    return {expert: sorted(run) for expert, run in runs.items()}


def test_an_expert_with_no_tokens_gets_no_tile():
    experts = torch.tensor([[0, 2], [2, 0], [0, 3]], device=DEVICE)  # expert 1: none
    slots, tile_experts = align_by_expert(experts, 4, block_m=4)
    assert tile_experts.tolist()[:3] == [0, 2, 3] and all(e == 4 for e in tile_experts.tolist()[3:])
    # slot = token * k + choice; 6: padding
    assert runs_of(slots, tile_experts, 4, 4) == {0: [0, 3, 4, 6], 2: [1, 2, 6, 6], 3: [5, 6, 6, 6]}


def test_many_slots_are_each_placed_once_in_their_experts_run():
    # 1,200 slots over two placing programs, 348 tiles over two passes of the tile loop, 64 experts of uneven loads
    generator = torch.Generator().manual_seed(0)
    experts = torch.multinomial(torch.linspace(0.1, 1.0, 64), 1200, replacement=True, generator=generator)
    experts = experts.view(600, 2).to(DEVICE)
    slots, tile_experts = align_by_expert(experts, 64, block_m=4)
    flat = experts.flatten().tolist()
    expected = {e: sorted(i for i, x in enumerate(flat) if x == e) for e in set(flat)}
    for run in expected.values():
        run.extend([1200] * (-len(run) % 4))
    assert runs_of(slots, tile_experts, 4, 64) == expected
    ends = torch.tensor([len(expected.get(e, [])) for e in range(64)]).cumsum(0)
    tile_starts = torch.arange(0, slots.numel(), 4)
    assert tile_experts.tolist() == torch.searchsorted(ends, tile_starts, right=True).tolist()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 tl.dot is wrong in Triton's interpreter")
def test_bf16_at_a_real_shape():
    generator = torch.Generator().manual_seed(0)
    x, router = torch.randn(64, 2048, generator=generator), torch.randn(128, 2048, generator=generator)
    weights, experts = (t.to(DEVICE) for t in route(x, router, 8, normalize=True))
    w_gate_up, w_down = (torch.randn(*shape, generator=generator).div(shape[-1] ** 0.5).to(DEVICE, torch.bfloat16)
                         for shape in ((128, 1536, 2048), (128, 2048, 768)))  # Qwen3-30B-A3B's experts
    x, weights = x.to(DEVICE, torch.bfloat16), weights.to(torch.bfloat16)
    expected = run_experts(x.float(), w_gate_up.float(), w_down.float(), weights.float(), experts, SiluAndMul())
    got = fused_experts(x, w_gate_up, w_down, weights, experts, "silu")
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("top_k, num_experts, num_tokens", [(1, 4, 37), (2, 8, 37), (8, 8, 3), (8, 8, 2)])
def test_int8_experts_match_the_torch_loop_over_the_same_codes(top_k, num_experts, num_tokens):
    """Experts as int8 codes with a scale per output channel (quantization='int8'): the kernels read the codes, and
    answer as the torch loop over the same codes does, grouped (37 tokens), a tile per slot (3 tokens x 8) and as
    matrix-vector products (2 tokens x 8)."""
    from fasterllm.layers.quantization.experts import quantize_stacked

    x, w_gate_up, w_down, weights, experts = moe_inputs(num_tokens, num_experts, 48, 40, top_k, seed=3)
    (gate_up_codes, gate_up_scales), (down_codes, down_scales) = (
        quantize_stacked(w, torch.int8) for w in (w_gate_up, w_down))
    assert gate_up_codes.dtype == torch.int8 and gate_up_scales.shape == (num_experts, 80)
    scales = (gate_up_scales, down_scales)
    expected = run_experts(x, gate_up_codes, down_codes, weights, experts, SiluAndMul(), scales)
    got = fused_experts(x, gate_up_codes, down_codes, weights, experts, "silu", scales=scales)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    # and both are the float experts' answer up to int8 rounding of the weights
    float_answer = run_experts(x, w_gate_up, w_down, weights, experts, SiluAndMul())
    assert (got - float_answer).abs().max() < 0.05 * float_answer.abs().max()


def test_scales_of_the_wrong_shape_are_refused():
    x, w_gate_up, w_down, weights, experts = moe_inputs(4, 4, 48, 40, 1)
    with pytest.raises(ValueError, match=r"one per output channel"):
        fused_experts(x, w_gate_up, w_down, weights, experts, "silu",
                      scales=(torch.ones(4, 40, device=DEVICE), torch.ones(4, 48, device=DEVICE)))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 tl.dot is wrong in Triton's interpreter; e4m3 needs a GPU")
@pytest.mark.parametrize("codes_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_quantized_experts_at_a_real_shape(codes_dtype, num_tokens):
    """Qwen3-30B-A3B's experts as int8 or e4m3 codes, bf16 activations: the kernels against the torch loop over the
    same codes in fp32."""
    from fasterllm.layers.quantization.experts import quantize_stacked

    generator = torch.Generator().manual_seed(1)
    x, router = torch.randn(num_tokens, 2048, generator=generator), torch.randn(128, 2048, generator=generator)
    weights, experts = (t.to(DEVICE) for t in route(x, router, 8, normalize=True))
    (gate_up, gate_up_scales), (down, down_scales) = (
        quantize_stacked(torch.randn(*shape, generator=generator).div(shape[-1] ** 0.5).to(DEVICE), codes_dtype)
        for shape in ((128, 1536, 2048), (128, 2048, 768)))
    x, weights = x.to(DEVICE, torch.bfloat16), weights.to(torch.bfloat16)
    scales = (gate_up_scales, down_scales)
    expected = run_experts(x.float(), gate_up.float(), down.float(), weights.float(), experts, SiluAndMul(), scales)
    got = fused_experts(x, gate_up, down, weights, experts, "silu", scales=scales)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def test_codes_stay_inside_their_format_and_close_to_the_weights():
    """A channel's absmax over its scale can round just past 127 or 448 (135 of 4,096 channels here reach
    448.00003): the codes are clamped to the format's range, and codes * scales stay within its rounding."""
    from fasterllm.layers.quantization.experts import quantize_stacked

    weight = torch.randn(2, 4096, 512, generator=torch.Generator().manual_seed(0))
    for codes_dtype, limit, rtol in ((torch.int8, 127, 1 / 127), (torch.float8_e4m3fn, 448, 1 / 16)):
        codes, scales = quantize_stacked(weight, codes_dtype)
        values = codes.float()
        assert torch.isfinite(values).all() and values.abs().amax() == limit
        error = (values * scales[..., None] - weight).abs()
        assert (error <= rtol * weight.abs().amax(dim=2, keepdim=True)).all()
