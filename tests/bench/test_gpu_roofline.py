"""The roofline's weight bytes per decode step: the embedding table counts only when the output head reads it, and a
mixture of experts' stacked experts only as far as a token's top_k."""
from __future__ import annotations

from torch import nn

from fasterllm.bench.gpu_roofline import active_parameters, weight_bytes_per_step
from fasterllm.layers.moe import SparseMoE

TABLE, PROJ = 1000 * 64 * 4, 64 * 64 * 4  # fp32 bytes
HALF_HEAD = 1000 * 64 * 2  # a separate head in fp16: a total that differs from the tied one


def model(tied: bool) -> nn.Module:
    m = nn.Module()
    m.embed_tokens = nn.Embedding(1000, 64)
    m.proj = nn.Linear(64, 64, bias=False)
    m.lm_head = nn.Linear(64, 1000, bias=False).half()
    if tied:  # what build_decoder makes of a tied head: a Linear over the table's own weight
        m.lm_head.weight = m.embed_tokens.weight
    return m


def test_a_tied_head_reads_the_table_every_step():
    assert weight_bytes_per_step(model(tied=True)) == TABLE + PROJ


def test_a_separate_head_replaces_the_table():
    assert weight_bytes_per_step(model(tied=False)) == PROJ + HALF_HEAD  # the head's own [1000, 64], not the table


def test_a_token_reads_and_multiplies_only_its_top_k_experts():
    m = model(tied=True)
    m.moe = SparseMoE(64, num_experts=8, top_k=2, intermediate_size=32, normalize=True, act=nn.SiLU())
    router, experts = 8 * 64 * 4, 8 * (2 * 32 * 64 + 64 * 32) * 4
    assert weight_bytes_per_step(m) == TABLE + PROJ + router + experts * 2 // 8
    # parameters, not bytes (fp32: 4 bytes each); the tied head's table counts once
    assert active_parameters(m) == (TABLE + PROJ + router + experts * 2 // 8) // 4
