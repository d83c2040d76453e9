"""Packed encoder inputs staged for a capacity (a CUDA graph's bucket): the layout, and that padding rows and
empty padding sequences leave the real tokens' hidden states as an exact-size batch gives them."""
from __future__ import annotations

import pytest
import torch

from fasterllm.layers.varlen_attention import VarlenBatch
from fasterllm.models.bert import BertConfig, BertModel
from fasterllm.worker.encoder_inputs import split_staged, stage_packed_inputs

SEQUENCES = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]


def test_staged_layout_pads_tokens_with_zeros_and_sequences_as_empty():
    staged = stage_packed_inputs(SEQUENCES, token_capacity=12, seq_capacity=5, pin=False)
    ids, positions, cu_seqlens = split_staged(staged, 12)
    assert ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 0, 0]
    assert positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0]
    assert cu_seqlens.tolist() == [0, 3, 4, 9, 9, 9]


def test_a_batch_over_the_capacity_is_refused():
    with pytest.raises(ValueError, match="9 tokens in 3 sequences exceed the capacity of 8 tokens and 4 sequences"):
        stage_packed_inputs(SEQUENCES, token_capacity=8, seq_capacity=4, pin=False)


def test_padding_rows_do_not_change_real_rows():
    torch.manual_seed(0)
    config = BertConfig("bert", 20, 16, 32, 2, 2, 16, 2, 1e-12, "gelu", 0)
    model = BertModel(config)
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.5)
    lengths = [len(s) for s in SEQUENCES]
    with torch.inference_mode():
        exact = model(*split_staged(stage_packed_inputs(SEQUENCES, 9, 3, pin=False), 9)[:2],
                      VarlenBatch.from_lengths(lengths, torch.device("cpu")))
        ids, positions, cu_seqlens = split_staged(stage_packed_inputs(SEQUENCES, 16, 8, pin=False), 16)
        padded = model(ids, positions, VarlenBatch.from_lengths(lengths, torch.device("cpu"), cu_seqlens))
    assert padded.shape == (16, 16)
    torch.testing.assert_close(padded[:9], exact)
