"""The offline API end to end on the real default model (fp32 CPU): sampling options and bad input."""
from dataclasses import replace

import pytest

from fasterllm import LLM, SamplingParams
from fasterllm.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", cpu_kv_cache_gib=0.25, max_model_len=1024)


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]


def test_outputs_come_back_in_input_order_with_token_ids_and_text(llm):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        completion = output.outputs[0]
        assert output.finished and len(completion.token_ids) == 8 and completion.finish_reason == "length"
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids)


def test_token_id_prompts_equal_text_prompts(llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    by_text, by_ids, by_dict = llm.generate([PROMPTS[0], ids, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert by_ids.prompt_token_ids == ids


def test_seeded_sampling_repeats_whatever_else_is_in_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=16)
    alone = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [SamplingParams(temperature=1.0, max_tokens=16)] * 3
    mixed = llm.generate(PROMPTS[:1] + PROMPTS[1:2] + PROMPTS[2:], crowd[:1] + [seeded] + crowd[1:], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=16)
    assert llm.generate(PROMPTS[1], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_strings_end_generation_and_are_not_in_the_text(llm):
    greedy = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    full = greedy.outputs[0].text
    assert " 6," in full, full
    stopped = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[" 6,"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 6,"
    assert stopped.text == full[:full.index(" 6,")]


def test_stop_token_ids_and_eos(llm):
    first = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    stop_id = first.token_ids[2]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first.token_ids[:3] and out.finish_reason == "stop" and out.stop_reason == stop_id
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200),
                    use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in chat.text


def test_ignore_eos_runs_to_max_tokens(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}],
                   SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"


def test_logprobs_with_top_alternatives(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert token_id in position and position[token_id].rank == 1  # greedy picks the top token
        ranked = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


def test_generation_stops_at_max_model_len():
    small = LLM(dtype="float32", max_model_len=40, cpu_kv_cache_gib=0.05)
    prompt = small.get_tokenizer().encode("Once upon a time")
    out = small.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == 40 and out.finish_reason == "length"


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt 0: The prompt is empty"),
    ([[]], "prompt 0: The prompt has no tokens"),
    ([], "generate() got no prompts"),
    ([1, 2, 10**7], "not valid: ids must be integers in [0, 49152)"),
    ("word " * 1100, "max_model_len is 1024"),
])
def test_bad_prompts_are_rejected_by_name(llm, prompt, message):
    with pytest.raises(ValueError, match=None) as info:
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
    assert message in str(info.value)


def test_a_bad_prompt_in_a_batch_runs_nothing_and_the_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="prompt 1: The prompt is empty"):
        llm.generate(["fine", "", "also fine"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_bad_request_mid_generation_does_not_disturb_running_ones(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    engine = llm.engine
    engine.add_request("ok-0", PROMPTS[0], params)
    engine.add_request("ok-1", PROMPTS[1], params)
    engine.step()
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("bad", PROMPTS[2], SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("bad", "word " * 1100, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok-0", PROMPTS[2], params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["ok-0"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert done["ok-1"].outputs[0].token_ids == expected[1].outputs[0].token_ids


def test_a_final_only_request_yields_one_output_with_what_a_cumulative_one_ends_with(llm):
    engine = llm.engine
    stop = SamplingParams(temperature=0, max_tokens=12, stop=[" the"])
    for request_id, params in (("each", stop), ("final", replace(stop, output_kind=RequestOutputKind.FINAL_ONLY))):
        engine.add_request(request_id, PROMPTS[1], params)
    seen = {"each": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert len(seen["each"]) > 1 and len(seen["final"]) == 1 and seen["final"][0].finished
    assert seen["final"][0].outputs == seen["each"][-1].outputs


def test_generate_reads_final_outputs_and_leaves_the_callers_params_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    assert len(llm.generate(PROMPTS, params, use_tqdm=False)) == len(PROMPTS)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"seed": "x"}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"n": 0}, "n=0"), ({"n": 2, "best_of": 1}, "best_of=1"),
])
def test_invalid_sampling_values_name_the_parameter(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_settings_errors_name_the_setting_and_fix(tmp_path):
    with pytest.raises(ValueError, match="max_model_len=8192 needs 512 blocks.*cpu_kv_cache_gib"):
        LLM(dtype="float32", num_kv_blocks=10)
    with pytest.raises(ValueError, match="max_model_len=99999 exceeds the model's max_position_embeddings=8192"):
        LLM(max_model_len=99999)
    with pytest.raises(ValueError, match="dtype='float8'"):
        LLM(dtype="float8")
    with pytest.raises(ValueError, match="block_size=7"):
        LLM(block_size=7)


def test_unknown_models_and_corrupt_files_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="'nobody/no-such-model' is not in the local Hugging Face cache"):
        LLM("nobody/no-such-model")
    with pytest.raises(FileNotFoundError, match="neither an existing path nor a Hugging Face hub id"):
        LLM(str(tmp_path / "missing" / "dir" / "x"))
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        LLM(str(corrupt))
    (tmp_path / "notmodel").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json and no .gguf"):
        LLM(str(tmp_path / "notmodel"))
    bad_config = tmp_path / "badcfg"
    bad_config.mkdir()
    (bad_config / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10, '
                                            '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, '
                                            '"num_attention_heads": 2}')
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        LLM(str(bad_config))


def test_logit_controls_reach_generation(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    plain = llm.chat(question, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert "Paris" in plain.text
    banned = llm.chat(question, SamplingParams(temperature=0, max_tokens=30, bad_words=["Paris"]),
                      use_tqdm=False)[0].outputs[0]
    assert "Paris" not in banned.text
    tokenizer = llm.get_tokenizer()
    long = llm.chat(question, SamplingParams(temperature=0, max_tokens=40, min_tokens=len(plain.token_ids) + 5),
                    use_tqdm=False)[0].outputs[0]
    assert len(long.token_ids) >= len(plain.token_ids) + 5
    assert tokenizer.eos_token_id not in long.token_ids[:len(plain.token_ids) + 5]
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    biased = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100}),
                          use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == [forced] * 4
    with pytest.raises(ValueError, match=r"logit_bias has token ids \[49152\] outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={49152: 1.0}), use_tqdm=False)
