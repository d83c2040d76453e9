"""The server through the official `openai` client: answers equal the offline API's, streams equal whole replies."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from fasterllm import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat_text(client, messages, **kwargs) -> str:
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, **kwargs)
    return reply.choices[0].message.content


def stream_chat_text(client, messages, **kwargs) -> str:
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, stream=True, **kwargs)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].max_model_len == 512


def test_chat_answers_as_the_offline_api_does(client, reference_llm):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0,
                                           max_tokens=24)
    expected = reference_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_completion_answers_as_the_offline_api_does(client, reference_llm):
    reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                      temperature=0, max_tokens=12)
    expected = reference_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))[0]
    assert reply.choices[0].text == expected.outputs[0].text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_chat_equals_the_whole_reply_and_ends_with_a_usage_chunk(client):
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0,
                                           max_tokens=24)
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0,
                                                 max_tokens=24, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completions_with_n_and_a_seed_equal_the_whole_reply(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="Once upon a time", temperature=1.0, max_tokens=10, n=2,
                  seed=7)
    whole = client.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert texts[0] != texts[1]  # two samples, not one twice
    assert usage.completion_tokens == whole.usage.completion_tokens == 20


def test_seeds_repeat_and_differ(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="My favourite animal is", temperature=1.0, max_tokens=16)
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert client.completions.create(seed=1234, **kwargs).choices[0].text == first
    assert client.completions.create(seed=4321, **kwargs).choices[0].text != first


def test_stop_strings_end_the_text_before_them(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="Count: 1, 2, 3, 4, 5, 6,", temperature=0, max_tokens=16)
    full = client.completions.create(**kwargs).choices[0].text
    assert " 9" in full
    stopped = client.completions.create(stop=[" 9"], **kwargs).choices[0]
    assert stopped.text == full[:full.index(" 9")] and stopped.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[" 9"], stream=True, **kwargs))
    assert streamed == stopped.text


def test_prompts_in_a_list_each_get_their_choices(client, reference_llm):
    prompts = ["The capital of France is", "1, 2, 3,"]
    reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts, temperature=0, max_tokens=6)
    expected = reference_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [e.outputs[0].text for e in expected]


def test_penalties_logit_bias_and_extra_fields_are_applied(client, reference_llm):
    paris = reference_llm.get_tokenizer().encode(" Paris", add_special_tokens=False)
    bias = {str(t): -100 for t in paris}
    text = chat_text(client, QUESTION, temperature=0, max_tokens=24, logit_bias=bias, frequency_penalty=0.5,
                     presence_penalty=0.3, extra_body={"top_k": 5, "min_p": 0.05})
    params = SamplingParams(temperature=0, max_tokens=24, logit_bias={t: -100 for t in paris}, frequency_penalty=0.5,
                            presence_penalty=0.3, top_k=5, min_p=0.05)
    assert "Paris" not in text
    assert text == reference_llm.chat(QUESTION, params)[0].outputs[0].text
    reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 40 and reply.choices[0].finish_reason == "length"


def test_logprobs_follow_the_openai_shapes(client):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0,
                                           max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert "".join(e.token for e in content).startswith(reply.choices[0].message.content)
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3,", temperature=0,
                                           max_tokens=5, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    assert all(len(top) == 2 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs,
                                                                             logprobs.token_logprobs))


def test_32_concurrent_streaming_chats_each_equal_the_chat_run_alone(client):
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello.",
                 "What is the largest ocean?", "Name a fruit.", "What colour is the sky?", "Count to three."]
    alone = {q: stream_chat_text(client, [{"role": "user", "content": q}], temperature=0, max_tokens=12)
             for q in questions}
    batch = [questions[i % len(questions)] for i in range(32)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(lambda q: stream_chat_text(client, [{"role": "user", "content": q}], temperature=0,
                                                            max_tokens=12), batch))
    assert together == [alone[q] for q in batch]
