"""The Triton varlen attention kernel against the SDPA path: on a GPU when there is one, else in Triton's
interpreter (TRITON_INTERPRET=1, small shapes)."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.varlen_attention import VarlenBatch, varlen_attention_sdpa

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")  # on the CPU, tests/conftest.py has set TRITON_INTERPRET=1 before triton's import
from fasterllm.kernels.varlen_attention import varlen_attention_triton  # noqa: E402


SHAPES = [  # (sequence lengths, heads, head_dim); the GPU also gets BERT-base shapes
    ([1, 5, 17, 3], 2, 16),
    ([40, 40, 7], 2, 24),  # head_dim not a power of two; two key blocks
] + ([([128] * 8 + [3, 500, 77], 12, 64), ([1] * 64, 16, 64)] if DEVICE.type == "cuda" else [])


# Triton 3.9's interpreter garbles bf16 loads (a plain load-store kernel does too); bf16 is checked on a GPU
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("lengths, heads, head_dim", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_sdpa_per_sequence(lengths, heads, head_dim, dtype):
    torch.manual_seed(0)
    batch = VarlenBatch.from_lengths(lengths, DEVICE)
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim, device=DEVICE).to(dtype)
    got = varlen_attention_triton(qkv, batch.cu_seqlens, batch.max_seqlen, heads)
    expected = varlen_attention_sdpa(qkv.float(), batch, heads)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2  # half types: rounding of p before p @ v
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_with_a_length_bound_and_padding_as_a_cuda_graph_runs_it(dtype):
    """A graph fixes max_seqlen at the model's limit and pads with rows of no sequence and empty sequences:
    the real rows still match SDPA per sequence."""
    torch.manual_seed(0)
    lengths, heads, head_dim, bound = [3, 20, 1], 2, 16, 64
    exact = VarlenBatch.from_lengths(lengths, DEVICE)
    qkv = torch.randn(32, 3 * heads * head_dim, device=DEVICE).to(dtype)  # 24 real rows, 8 padding rows
    cu_seqlens = torch.tensor([0, 3, 23, 24, 24, 24], dtype=torch.int32, device=DEVICE)  # two empty sequences
    got = varlen_attention_triton(qkv, cu_seqlens, bound, heads)
    expected = varlen_attention_sdpa(qkv[:24].float(), exact, heads)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:24].float(), expected, atol=tolerance, rtol=tolerance)
