"""Encoder-decoder models (BART, Marian, mBART, M2M100, T5 v1.0 and v1.1) against transformers on the same weights, fp32 on the CPU:
greedy tokens of a mixed batch whose requests arrive at different steps (one with a decoder prompt computed in
chunks), under preemption, and beam search hypotheses and scores.
"""
from __future__ import annotations

import pytest
import torch

from fasterllm import LLM, BeamSearchParams, SamplingParams
from seq2seq_models import FAMILIES, hf_generate

pytest.importorskip("transformers")

EOS = 2
# encoder inputs of several lengths (one past two blocks of 8), each ending in eos as a tokenizer would write it
INPUTS = [[5, 9, 11, 3, 7, EOS], [8, 4, EOS], list(range(3, 40)) + [EOS], [17, 23, 29, 31, 37, 41, 43, 47, EOS]]
DECODER_PROMPT = [12, 30, 7, 19, 44, 9, 21, 60, 33, 15]  # ten tokens: three chunks of at most four


def make_llm(directory, **overrides) -> LLM:
    settings = dict(dtype="float32", device="cpu", num_kv_blocks=64, block_size=8, max_num_batched_tokens=128,
                    long_prefill_token_threshold=4)
    settings.update(overrides)
    return LLM(str(directory), **settings)


def reference_tokens(model, encoder_ids: list[int], max_tokens: int, decoder_prompt: list[int] | None = None):
    """transformers' greedy continuation (after the decoder's start token and prompt), up to and with eos."""
    start = model.config.decoder_start_token_id
    kwargs = {} if decoder_prompt is None else {
        "decoder_input_ids": torch.tensor([[start, *decoder_prompt]], device=model.device)}
    out = hf_generate(model, encoder_ids, max_tokens, eos_token_id=EOS, pad_token_id=0, **kwargs)[0].tolist()
    tokens = out[1 + len(decoder_prompt or []):]
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def run_staggered(llm: LLM, prompts: list, params: SamplingParams, arrivals: list[int]) -> list[list[int]]:
    """Add prompt i before step arrivals[i]; step until all finish; each one's tokens."""
    engine = llm.engine
    outputs: dict[str, list[int]] = {}
    step = 0
    while len(outputs) < len(prompts):
        for index, arrival in enumerate(arrivals):
            if arrival == step:
                engine.add_request(f"r{index}", prompts[index], params)
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        step += 1
    return [outputs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_in_a_staggered_batch(tiny_seq2seq, family):
    directory, model = tiny_seq2seq[family]
    llm = make_llm(directory)
    prompts = INPUTS + [{"encoder_prompt": INPUTS[0], "decoder_prompt": DECODER_PROMPT}]
    params = SamplingParams(max_tokens=12, temperature=0)
    got = run_staggered(llm, prompts, params, arrivals=[0, 0, 2, 3, 1])
    for encoder_ids, tokens in zip(INPUTS, got):
        assert tokens == reference_tokens(model, encoder_ids, 12), encoder_ids
    assert got[-1] == reference_tokens(model, INPUTS[0], 12, DECODER_PROMPT)
    assert len({tuple(t) for t in got}) > 1  # the inputs matter: not one collapsed sequence for all
    assert llm.engine.kv_cache.num_free_blocks == 64


def test_text_prompt_and_output_fields(tiny_seq2seq):
    directory, model = tiny_seq2seq["bart"]
    llm = make_llm(directory)
    text = "w5 w9 w11 w3 w7"
    [output] = llm.generate(text, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    encoder_ids = llm.get_tokenizer().encode(text)
    assert output.encoder_prompt == text and output.encoder_prompt_token_ids == encoder_ids
    assert output.prompt_token_ids == [model.config.decoder_start_token_id]
    assert output.outputs[0].token_ids == reference_tokens(model, encoder_ids, 6)
    assert output.outputs[0].text == llm.get_tokenizer().decode(output.outputs[0].token_ids)
    # logprobs of each generated token, and a stop string cutting the text where it appears
    first_word = output.outputs[0].text.split()[0]
    [stopped] = llm.generate(text, SamplingParams(max_tokens=6, temperature=0, logprobs=2, stop=[first_word]),
                             use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.text == "" and completion.finish_reason == "stop" and completion.stop_reason == first_word
    assert len(completion.logprobs) == len(completion.token_ids) == 1
    assert completion.logprobs[0][completion.token_ids[0]].rank == 1


@pytest.mark.parametrize("family", ["bart", "m2m_100", "t5_v1_1"])
def test_greedy_tokens_survive_preemption(tiny_seq2seq, family):
    """A pool too small for all at once: requests are preempted (their cross blocks freed, their encoders run
    again on re-admission) and still give transformers' tokens."""
    directory, model = tiny_seq2seq[family]
    llm = make_llm(directory, num_kv_blocks=12, max_num_seqs=4, watermark=0)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = llm.generate(INPUTS, params, use_tqdm=False)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for encoder_ids, output in zip(INPUTS, outputs):
        reference = hf_generate(model, encoder_ids, 24, eos_token_id=None, pad_token_id=0)[0, 1:].tolist()
        assert output.outputs[0].token_ids == reference
    assert llm.engine.kv_cache.num_free_blocks == 12


def test_seeded_samples_do_not_depend_on_the_batch(tiny_seq2seq):
    directory, _ = tiny_seq2seq["marian"]
    llm = make_llm(directory)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3)
    [alone] = llm.generate([INPUTS[2]], params, use_tqdm=False)
    together = llm.generate(INPUTS, params, use_tqdm=False)[2]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in together.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1


def hf_beam_search(model, encoder_ids: list[int], width: int, max_tokens: int, length_penalty: float,
                   early_stopping) -> list[tuple[list[int], float]]:
    out = hf_generate(model, encoder_ids, max_tokens, num_beams=width, num_return_sequences=width,
                      length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=EOS, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True)
    if width == 1:  # transformers decodes greedily: score its one sequence as a search would
        tokens = out.sequences[0, 1:].tolist()
        steps = [torch.log_softmax(step[0], dim=-1)[token].item() for step, token in zip(out.scores, tokens)]
        tokens = tokens[:len(steps)]
        return [(tokens, sum(steps) / len(tokens) ** length_penalty)]
    hypotheses = []
    for sequence, score in zip(out.sequences, out.sequences_scores.tolist()):
        tokens = sequence[1:].tolist()  # after the decoder's start token
        if EOS in tokens:  # shorter hypotheses are padded after their eos
            tokens = tokens[:tokens.index(EOS) + 1]
        hypotheses.append((tokens, score))
    return hypotheses


@pytest.mark.parametrize("family, width, length_penalty, early_stopping",
                         [("bart", 1, 1.0, False), ("bart", 2, 1.0, False), ("bart", 4, 1.0, True),
                          ("marian", 4, 0.5, False), ("m2m_100", 4, -0.5, True), ("mbart", 2, 2.0, "never"),
                          ("t5", 4, 1.0, False), ("t5_v1_1", 2, 0.5, True)])
def test_beam_search_matches_transformers(tiny_seq2seq, family, width, length_penalty, early_stopping):
    directory, model = tiny_seq2seq[family]
    llm = make_llm(directory)
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outputs = llm.beam_search(INPUTS, params, use_tqdm=False)
    for encoder_ids, output in zip(INPUTS, outputs):
        reference = hf_beam_search(model, encoder_ids, width, 10, length_penalty, early_stopping)
        assert [s.token_ids for s in output.sequences] == [tokens for tokens, _ in reference], encoder_ids
        for sequence, (_, score) in zip(output.sequences, reference):
            assert sequence.score == pytest.approx(score, abs=1e-4)
    assert llm.engine.kv_cache.num_free_blocks == 64


@pytest.mark.parametrize("method", ["int8", "w8a8"])
@pytest.mark.parametrize("family", ["bart", "t5"])
def test_quantized_encoder_decoder_models_answer_like_the_float_one(tiny_seq2seq, family, method):
    """Every linear of the encoder and the decoder (cross-attention's too) quantized at load: the first tokens, far
    from ties on these models, stay the float model's."""
    directory, _ = tiny_seq2seq[family]
    params = SamplingParams(max_tokens=2, temperature=0)
    float_tokens = [o.outputs[0].token_ids[0] for o in make_llm(directory).generate(INPUTS, params, use_tqdm=False)]
    quantized = make_llm(directory, quantization=method)
    assert [o.outputs[0].token_ids[0] for o in quantized.generate(INPUTS, params, use_tqdm=False)] == float_tokens
