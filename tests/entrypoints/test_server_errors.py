"""Bad requests get an OpenAI-style error naming the field, with the right 4xx status; everyone else is served."""
from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
LONG_PROMPT = "word " * 600  # 601 tokens (the trailing space is one): over max_model_len=512


@pytest.mark.parametrize("path, body, status, param, message", [
    ("completions", {**COMPLETION, "model": "gpt-4"}, 404, "model", "The model 'gpt-4' does not exist"),
    ("chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model", "this server serves 'SmolLM2-135M-Instruct'"),
    ("completions", {**COMPLETION, "max_tokens": -5}, 400, "max_tokens", "greater than or equal to 1"),
    ("completions", {**COMPLETION, "max_tokens": 10**9}, 400, "max_tokens",
     "max_tokens=1000000000 is too large: the prompt has 1 tokens and this model's maximum context length is 512, "
     "so max_tokens can be at most 511"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 100000}, 400, "max_completion_tokens",
     "max_completion_tokens=100000 is too large"),
    ("completions", {**COMPLETION, "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    ("completions", {**COMPLETION, "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ("chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("chat/completions", {**CHAT, "top_p": 0}, 400, "top_p", "greater than 0"),
    ("completions", {**COMPLETION, "prompt": LONG_PROMPT}, 400, "prompt",
     "This model's maximum context length is 512 tokens, but the prompt has 601 tokens"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
     "maximum context length is 512 tokens"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least 1 item"),
    ("chat/completions", {**CHAT, "messages": "Hi"}, 400, "messages", "valid list"),
    ("chat/completions", {**CHAT, "messages": [{"content": "Hi"}]}, 400, "messages", "messages.0.role: Field required"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}]},
     400, "messages", "messages.1.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400, "messages",
     "messages.0: Value error, a user message needs content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "4"}]},
     400, "messages", "messages.1: Value error, a tool message needs tool_call_id"),
    ("completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature", "valid number"),
    ("completions", {**COMPLETION, "prompt": 3}, 400, "prompt", "is none of the accepted types"),
    ("completions", {**COMPLETION, "prompt": ""}, 400, "prompt", "prompt 0 is empty"),
    ("completions", {**COMPLETION, "prompt": []}, 400, "prompt", "prompt is an empty list"),
    ("completions", {**COMPLETION, "prompt": [5, 99999999]}, 400, "prompt",
     "prompt token ids [99999999] are not valid: ids must be integers in [0, 49152)"),
    ("completions", {**COMPLETION, "frobnicate": 1}, 400, "frobnicate", "Extra inputs are not permitted"),
    ("completions", {**COMPLETION, "n": 0}, 400, "n", "greater than or equal to 1"),
    ("completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, "logit_bias", "keys must be token ids"),
    ("completions", {**COMPLETION, "logit_bias": {"5": 500}}, 400, "logit_bias", "out of range"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs=true"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", "less than or equal"),
    ("completions", {**COMPLETION, "stream": True, "best_of": 3}, 400, "best_of", "must equal n=1 when streaming"),
    ("completions", {**COMPLETION, "guided_regex": "(unclosed"}, 400, "guided_regex", "unclosed group"),
    ("completions", {**COMPLETION, "structured_outputs": {"grammar": "start: nothing_here"}}, 400,
     "structured_outputs", 'unknown name: "nothing_here"'),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format", "needs json_schema.schema"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, 400, "response_format",
     "Invalid type: no-such-type"),
    ("completions", {**COMPLETION, "guided_choice": ["a"], "guided_regex": "b"}, 400, "guided_regex",
     "set exactly one of"),
    ("completions", {**COMPLETION, "guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, 400,
     "structured_outputs", "use one of them"),
    ("completions", {**COMPLETION, "structured_outputs": {"schema": {}}}, 400, "structured_outputs",
     "unknown fields ['schema']"),
])
def test_bad_request_gets_its_status_and_names_the_field(server, path, body, status, param, message):
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["param"] == param and error["code"] == status


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]"])
def test_malformed_json_is_a_400(server, content):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "BadRequestError"


def test_the_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be less than or equal to 2"):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], temperature=9)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="Hi")


def test_bad_requests_in_the_middle_of_good_ones_hurt_nobody(server, client):
    expected = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=24,
                                         extra_body={"ignore_eos": True}).choices[0].text
    stream = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=24, stream=True,
                                       extra_body={"ignore_eos": True})
    text = next(iter(stream)).choices[0].text
    for body in ({**COMPLETION, "temperature": 5}, {**COMPLETION, "prompt": LONG_PROMPT},
                 {**COMPLETION, "prompt": [99999999]}, {**COMPLETION, "logit_bias": {"99999999": 1}}):
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 400
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == expected
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_embeddings_without_an_embedding_model_say_how_to_enable_them(client):
    with pytest.raises(openai.NotFoundError, match="start it with `fasterllm serve --embedding-model default`"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="hi")
