"""Beam search parity with transformers' generate(num_beams=k) on SmolLM2 (fp32, CPU).

Every hypothesis (tokens, eos included) and its length-penalised score must equal transformers' for
beam widths 1, 2 and 4, each early_stopping mode, positive, zero and negative length penalties, and
prompts that end in eos as well as ones that run to the token limit, with all prompts searched in
one batch.
"""
from __future__ import annotations

import pytest
import torch

from fasterllm import BeamSearchParams, SamplingParams
from fasterllm.worker import beam_follow

pytest.importorskip("transformers")

QUESTIONS = ["What is the capital of France?", "What is 2+2?"]
TEXT_PROMPT = "The best way to learn a new language is"


@pytest.fixture(scope="module")
def chat_prompts(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": q}], True) for q in QUESTIONS]


def hf_beam_search(model, token_ids: list[int], eos: list[int], width: int, max_tokens: int,
                   length_penalty: float, early_stopping) -> list[tuple[list[int], float]]:
    out = model.generate(torch.tensor([token_ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                         max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                         eos_token_id=eos, pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True)
    hypotheses = []
    for sequence, score in zip(out.sequences, out.sequences_scores.tolist()):
        tokens = sequence[len(token_ids):].tolist()
        if eos[0] in tokens:  # shorter hypotheses are padded after their eos
            tokens = tokens[:tokens.index(eos[0]) + 1]
        hypotheses.append((tokens, score))
    return hypotheses


@pytest.mark.parametrize("width, length_penalty, early_stopping",
                         [(2, 1.0, False), (4, 1.0, True), (4, 0.0, "never"), (4, -0.5, False)])
def test_hypotheses_and_scores_match_transformers(smollm2_llm, hf_smollm2, chat_prompts, width, length_penalty,
                                                  early_stopping):
    tok = smollm2_llm.get_tokenizer()
    eos = smollm2_llm.engine.tokenizer.eos_token_ids
    prompts = chat_prompts + [TEXT_PROMPT]
    params = BeamSearchParams(beam_width=width, max_tokens=20, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outputs = smollm2_llm.beam_search(prompts, params, use_tqdm=False)
    reasons = set()
    for prompt, output in zip(prompts, outputs):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert output.prompt_token_ids == ids
        reference = hf_beam_search(hf_smollm2, ids, eos, width, 20, length_penalty, early_stopping)
        assert [s.token_ids for s in output.sequences] == [tokens for tokens, _ in reference], prompt
        for sequence, (_, score) in zip(output.sequences, reference):
            assert sequence.score == pytest.approx(score, abs=1e-3)
            assert sequence.text == tok.decode(sequence.token_ids, skip_special_tokens=True)
            reasons.add(sequence.finish_reason)
        assert [s.score for s in output.sequences] == sorted((s.score for s in output.sequences), reverse=True)
    assert reasons == {"stop", "length"}  # eos-ended and length-ended hypotheses were both checked
    assert smollm2_llm.engine.kv_cache.num_free_blocks == smollm2_llm.engine.kv_cache.num_blocks


def test_width_one_is_greedy(smollm2_llm):
    greedy = smollm2_llm.generate(TEXT_PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    beam = smollm2_llm.beam_search(TEXT_PROMPT, BeamSearchParams(beam_width=1, max_tokens=16), use_tqdm=False)
    assert [s.token_ids for s in beam[0].sequences] == [greedy[0].outputs[0].token_ids]


def test_lookahead_steps_following_the_selection_on_the_device_give_the_same_hypotheses(gguf, chat_prompts,
                                                                                        monkeypatch):
    """With asynchronous scheduling a search's next decode step is launched before the step in flight has selected:
    its slots take their inputs, tables and ranking from that selection where it is (worker/beam_follow.py). Blocks of
    8 tokens: block boundaries and moved slots' copies of partly filled blocks every few steps. The hypotheses equal
    the synchronous engine's."""
    from fasterllm import LLM
    from fasterllm.worker import model_runner

    followed = []
    monkeypatch.setattr(model_runner, "follow_on_host",
                        lambda *args: followed.append(args[0]) or beam_follow.follow_on_host(*args))
    prompts = chat_prompts + [TEXT_PROMPT]
    params = BeamSearchParams(beam_width=4, max_tokens=20, length_penalty=0.5)
    outputs = {}
    for asynchronous in (False, True):
        llm = LLM(str(gguf), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=160, block_size=8,
                  async_scheduling=asynchronous)
        outputs[asynchronous] = [[(s.token_ids, s.score) for s in output.sequences]
                                 for output in llm.beam_search(prompts, params, use_tqdm=False)]
    assert sum(slots.num_slots for slots in followed) >= 3 * 4 * 15  # most decode steps followed on the device
    for got, want in zip(outputs[True], outputs[False]):
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        assert [score for _, score in got] == pytest.approx([score for _, score in want], abs=1e-5)
