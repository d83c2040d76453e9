"""Greedy generation parity with transformers under continuous batching (fp32, CPU).

Requests are added to the engine at different steps, so prompts are prefilled (whole or in chunks)
in the same forward passes as other requests' decode tokens; every request must still produce
exactly the tokens transformers' `generate(do_sample=False)` produces for its prompt alone.

On the reference side we use plain greedy `generate(max_new_tokens=32)` and check that it ran the full
32 tokens without meeting EOS, rather than `min_new_tokens=32`: min_new_tokens masks the EOS logit,
which changes the greedy path wherever EOS would win, while our ignore_eos=True only stops the stop.
"""
from __future__ import annotations

import pytest

from fasterllm import LLM, SamplingParams
from parity_utils import NEW_TOKENS, SMOLLM2_TEXTS, TINY_SPECS, first_divergence, hf_greedy, random_prompt, run_staggered, watch_steps

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

# the engine step before which each request is added: all different, most while others are decoding
ARRIVAL_STEPS = [0, 1, 3, 6, 10, 17]


@pytest.fixture(scope="module")
def smollm2_tight_llm(gguf):
    """Tight settings: 16-token steps (chunked prefill, prefill mixed with decodes), 4 sequences at a time
    (a waiting queue) and 12 blocks of 16 tokens for up to 4 requests of up to 92 tokens (preemption)."""
    return LLM(str(gguf), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=12, block_size=16,
               max_num_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(params=["roomy", "tight"])
def engine_llm(request):
    return request.getfixturevalue("smollm2_llm" if request.param == "roomy" else "smollm2_tight_llm")


def test_smollm2_staggered_greedy_matches_transformers(engine_llm, smollm2_prompts, smollm2_reference,
                                                       monkeypatch):
    engine = engine_llm.engine
    preemptions_before = engine.stats().num_preemptions
    log = watch_steps(monkeypatch, engine)
    outputs = run_staggered(engine, smollm2_prompts, ARRIVAL_STEPS, GREEDY)
    preemptions = engine.stats().num_preemptions - preemptions_before
    print(f"{len(log.steps)} steps, {log.mixed_steps} mixed prefill+decode, "
          f"{log.continued_prompt_chunks} continued prompt chunks, {preemptions} preemptions")
    for i, ref in enumerate(smollm2_reference):
        ours = outputs[f"staggered-{i}"]
        assert ours == ref, f"prompt {i} ({SMOLLM2_TEXTS[i][:30]!r}): {first_divergence(ours, ref)}"
    # the schedule really interleaved the requests
    assert log.mixed_steps > 0
    assert max(len(step) for step in log.steps) >= 3
    if engine.scheduler_config.max_num_batched_tokens == 16:
        assert log.continued_prompt_chunks > 0
        assert max(sum(item.num_new for item in step) for step in log.steps) == 16
        assert preemptions > 0


def test_request_arriving_mid_generation_is_unaffected(engine_llm, smollm2_prompts):
    """A request produces the same tokens alone and when it joins another one mid-generation."""
    long_prompt, short_prompt = smollm2_prompts[1], smollm2_prompts[3]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [engine_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
             for p in (long_prompt, short_prompt)]
    together = run_staggered(engine_llm.engine, [long_prompt, short_prompt], [0, 9], params)
    assert together["staggered-0"] == alone[0], first_divergence(together["staggered-0"], alone[0])
    assert together["staggered-1"] == alone[1], first_divergence(together["staggered-1"], alone[1])


def test_smollm2_chat_knows_paris(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text


def test_smollm2_eos_stop_matches_transformers(smollm2_llm, hf_smollm2, hf_smollm2_tokenizer):
    """Without ignore_eos both stop at the same EOS; with it we carry on past it along the same path."""
    messages = [{"role": "user", "content": "Say hi."}]
    ids = smollm2_llm.get_tokenizer().encode_chat(messages)
    ref = hf_greedy(hf_smollm2, ids, NEW_TOKENS)
    assert len(ref) < NEW_TOKENS and ref[-1] == hf_smollm2_tokenizer.eos_token_id, \
        "transformers no longer stops early on this prompt; pick another"

    stopped = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    out = stopped[0].outputs[0]
    assert out.token_ids == ref, first_divergence(out.token_ids, ref)
    assert out.finish_reason == "stop"
    assert out.text == hf_smollm2_tokenizer.decode(ref, skip_special_tokens=True)

    ignored = smollm2_llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == NEW_TOKENS and ignored.finish_reason == "length"
    assert ignored.token_ids[:len(ref)] == ref


# ---- a tiny random-weight model ------------------------------------------------------------------------

TINY_PROMPT_LENGTHS = [3, 60, 17, 41, 9]
TINY_ARRIVALS = [0, 2, 3, 7, 12]


# llama3_gqa: GQA + llama3 rope scaling; the Gemmas: an 8-token window on layer 0 (and Gemma 2's soft caps, Gemma 3's
# two RoPE tables) across chunks, decodes and preemption; the mixtures of experts: each token routed alone whatever
# else is in the batch; DeepSeek-V2's latent attention over the padded cache
@pytest.mark.parametrize("name", ["llama3_gqa", "gemma2_softcap_window", "gemma3_local_global", "mixtral_moe",
                                  "qwen2_moe_shared", "olmoe_clip", "deepseek_v2_lite_yarn",
                                  "deepseek_v2_q_lora_groups"])
def test_tiny_model_staggered_greedy_matches_transformers(tiny_checkpoints, monkeypatch, name):
    spec = next(s for s in TINY_SPECS if s.name == name)
    directory, hf_model = tiny_checkpoints[name]
    prompts = [random_prompt(n, spec.vocab_size, 100 + n) for n in TINY_PROMPT_LENGTHS]
    # the random model may well pick EOS: let transformers run on through it, as ignore_eos does for us
    monkeypatch.setattr(hf_model.generation_config, "eos_token_id", None)
    refs = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    assert all(len(r) == NEW_TOKENS for r in refs)
    # 8-token blocks and 8-token steps; 16 blocks of 8 for requests of up to 92 tokens
    llm = LLM(str(directory), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=16, block_size=8,
              max_num_batched_tokens=8, max_num_seqs=3)
    log = watch_steps(monkeypatch, llm.engine)
    outputs = run_staggered(llm.engine, prompts, TINY_ARRIVALS, GREEDY)
    print(f"{len(log.steps)} steps, {log.mixed_steps} mixed prefill+decode, "
          f"{log.continued_prompt_chunks} continued prompt chunks, "
          f"{llm.engine.stats().num_preemptions} preemptions")
    for i, ref in enumerate(refs):
        ours = outputs[f"staggered-{i}"]
        assert ours == ref, f"prompt {i} ({len(prompts[i])} tokens): {first_divergence(ours, ref)}"
    assert log.mixed_steps > 0 and log.continued_prompt_chunks > 0
