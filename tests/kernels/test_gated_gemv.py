"""The matrix-vector kernel's gated input (kernels/gemv.py, gated=True): a SiLU-gated FFN's down projection reading
[gate | up] and computing silu(gate) * up itself gives the product of the activation's own output bit for bit, in
every weight layout; and a model whose down projections take it (layers/gpu_linear.fuse_silu_and_mul) answers as
before. In Triton's interpreter on a CPU, natively on a GPU."""
from __future__ import annotations

import pytest
import torch
from torch import nn

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")
from fasterllm.kernels.activation import silu_and_mul  # noqa: E402
from fasterllm.kernels.gemv import gemv  # noqa: E402

N, K, GROUP = 48, 320, 32
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _weights(layout: str, generator: torch.Generator, dtype: torch.dtype) -> dict:
    """gemv's keyword arguments for a random weight of N x K in `layout`."""
    if layout == "float":
        return dict(weight=(torch.randn(N, K, generator=generator) / 16).to(dtype))
    if layout == "int8":
        return dict(weight=torch.randint(-128, 128, (N, K), generator=generator, dtype=torch.int8),
                    scales=torch.rand(N, generator=generator) / 64)
    bits = 4 if layout == "int4" else 8
    codes = torch.randint(0, 256, (N, K * bits // 8), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(N, K // GROUP, generator=generator) / 64).to(torch.float16)
    return dict(weight=codes, scales=scales, minimums=-8 * scales, group_size=GROUP, code_bits=bits)


@pytest.mark.parametrize("layout", ["float", "int8", "int4", "uint8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_input_gives_the_activations_product(layout, dtype):
    generator = torch.Generator().manual_seed(3)
    weights = {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t
               for name, t in _weights(layout, generator, dtype).items()}
    bias = torch.randn(N, generator=generator).to(DEVICE, dtype)
    gate_up = (torch.randn(1, 2 * K, generator=generator) * 2).to(DEVICE, dtype)
    fused = gemv(gate_up, bias=bias, gated=True, **weights)
    unfused = gemv(silu_and_mul(gate_up), bias=bias, **weights)
    assert torch.equal(fused, unfused)
    with pytest.raises(ValueError, match=r"\[gate \| up\], 2K"):
        gemv(gate_up[:, :K], gated=True, **weights)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="GPULinear's other rows go through cuBLAS")
def test_a_layer_whose_down_projection_takes_the_gate_answers_as_before():
    from fasterllm.layers.activation import SiluAndMul
    from fasterllm.layers.gpu_linear import GPULinear, fuse_silu_and_mul

    generator = torch.Generator().manual_seed(5)
    layer = nn.Module()
    layer.act = SiluAndMul()
    layer.down_proj = GPULinear((torch.randn(N, K, generator=generator) / 16).to(DEVICE, torch.bfloat16), None)
    gate_up = torch.randn(9, 2 * K, generator=generator).to(DEVICE, torch.bfloat16)
    before = [layer.down_proj(layer.act(gate_up[:rows])) for rows in (1, 9)]
    fuse_silu_and_mul(layer)
    assert isinstance(layer.act, nn.Identity) and layer.down_proj.gated_input
    after = [layer.down_proj(layer.act(gate_up[:rows])) for rows in (1, 9)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
