"""On a GPU: encoder-decoder models through the Triton kernels (self-attention stored without rotary positions, T5's
relative-position bias from its table, cross-attention non-causal over the cross blocks, the encoder's varlen
kernel) and decode steps replayed from CUDA graphs, fp32 against transformers on the GPU: greedy tokens of a
staggered batch and beam search hypotheses. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from fasterllm import BeamSearchParams, SamplingParams
from seq2seq_models import FAMILIES
from test_encoder_decoder_parity import (DECODER_PROMPT, INPUTS, hf_beam_search, make_llm, reference_tokens,
                                         run_staggered)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")


def gpu_llm(directory):
    return make_llm(directory, device="cuda", max_num_seqs=16)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_on_the_gpu(tiny_seq2seq, family):
    directory, model = tiny_seq2seq[family]
    llm = gpu_llm(directory)
    assert llm.engine.executor.runner.graphs is not None  # decode steps replay CUDA graphs (T5's bias in the kernel too)
    prompts = INPUTS + [{"encoder_prompt": INPUTS[0], "decoder_prompt": DECODER_PROMPT}]
    got = run_staggered(llm, prompts, SamplingParams(max_tokens=12, temperature=0), arrivals=[0, 0, 2, 3, 1])
    runner = llm.engine.executor.runner
    # every encoder pass of these small batches replayed from a CUDA graph captured at start-up (T5's run eagerly)
    assert (runner.encoder_graphs is not None) == runner.model.replayable_encoder
    model = model.cuda()
    try:
        for encoder_ids, tokens in zip(INPUTS, got):
            assert tokens == reference_tokens(model, encoder_ids, 12), encoder_ids
        assert got[-1] == reference_tokens(model, INPUTS[0], 12, DECODER_PROMPT)
    finally:
        model.cpu()


@pytest.mark.parametrize("family", ["bart", "marian", "t5_v1_1"])
def test_beam_search_matches_transformers_on_the_gpu(tiny_seq2seq, family):
    directory, model = tiny_seq2seq[family]
    llm = gpu_llm(directory)
    params = BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=1.0)
    outputs = llm.beam_search(INPUTS, params, use_tqdm=False)
    model = model.cuda()
    try:
        for encoder_ids, output in zip(INPUTS, outputs):
            reference = hf_beam_search(model, encoder_ids, 4, 10, 1.0, False)
            assert [s.token_ids for s in output.sequences] == [tokens for tokens, _ in reference], encoder_ids
            for sequence, (_, score) in zip(output.sequences, reference):
                assert sequence.score == pytest.approx(score, abs=1e-3)
    finally:
        model.cpu()


def test_graph_replays_give_the_eager_tokens_in_bf16(tiny_seq2seq):
    directory, _ = tiny_seq2seq["bart"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    graphs = make_llm(directory, device="cuda", dtype="bfloat16").generate(INPUTS, params, use_tqdm=False)
    eager = make_llm(directory, device="cuda", dtype="bfloat16", enforce_eager=True).generate(INPUTS, params,
                                                                                             use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
