"""use_beam_search through the server with the `openai` client: the choices are LLM.beam_search's hypotheses."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import wait_for

from fasterllm import BeamSearchParams

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The best way to learn a language is"
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


def chat_prompt(reference_llm, messages) -> dict:
    return {"prompt_token_ids": reference_llm.get_tokenizer().encode_chat(messages)}


def test_completion_choices_are_the_offline_hypotheses_best_first(client, reference_llm):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=8, temperature=0,
                                      extra_body={"use_beam_search": True})
    (expected,) = reference_llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=8), use_tqdm=False)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [s.text for s in expected.sequences]
    assert [c.finish_reason for c in reply.choices] == [s.finish_reason for s in expected.sequences]
    assert len({c.text for c in reply.choices}) == 3  # three hypotheses, not one three times
    assert reply.usage.completion_tokens == sum(len(s.token_ids) for s in expected.sequences)
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_best_of_is_the_width_and_the_beam_fields_reach_the_search(client, reference_llm):
    # token ids of a chat turn: its hypotheses end (eos) at different lengths, so length_penalty matters
    prompts = [chat_prompt(reference_llm, QUESTION), {"prompt_token_ids": reference_llm.get_tokenizer().encode(PROMPT)}]
    fields = {"length_penalty": 2.0, "early_stopping": "never"}
    reply = client.completions.create(model=MODEL, prompt=[p["prompt_token_ids"] for p in prompts], n=2, best_of=4,
                                      max_tokens=16, extra_body={"use_beam_search": True, **fields})
    expected = reference_llm.beam_search(prompts, BeamSearchParams(beam_width=4, n=2, max_tokens=16, **fields),
                                         use_tqdm=False)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [s.text for e in expected for s in e.sequences]
    default = reference_llm.beam_search(prompts[0], BeamSearchParams(beam_width=4, n=2, max_tokens=16), use_tqdm=False)
    assert [c.text for c in reply.choices[:2]] != [s.text for s in default[0].sequences]


def test_chat_beam_search_whole_and_streamed(client, reference_llm):
    kwargs = dict(model=MODEL, messages=QUESTION, n=2, max_tokens=16, extra_body={"use_beam_search": True})
    whole = client.chat.completions.create(**kwargs)
    (expected,) = reference_llm.beam_search(chat_prompt(reference_llm, QUESTION),
                                            BeamSearchParams(beam_width=2, max_tokens=16), use_tqdm=False)
    assert [c.message.content for c in whole.choices] == [s.text for s in expected.sequences]
    assert [c.finish_reason for c in whole.choices] == [s.finish_reason for s in expected.sequences]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    content_chunks = [c for c in chunks if c.choices and any(choice.delta.content for choice in c.choices)]
    assert len(content_chunks) == 1  # the hypotheses are only known when the search ends: one chunk carries them
    streamed = {choice.index: (choice.delta.content, choice.finish_reason) for choice in content_chunks[0].choices}
    assert streamed == {c.index: (c.message.content, c.finish_reason) for c in whole.choices}
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


@pytest.mark.parametrize("path, fields, param, message", [
    ("completions", {"temperature": 0.7}, "temperature", "temperature=0.7 cannot be used with use_beam_search=true"),
    ("chat/completions", {"top_p": 0.9}, "top_p", "top_p=0.9 cannot be used with use_beam_search=true"),
    ("completions", {"top_k": 5}, "top_k", "top_k=5 cannot be used"),
    ("completions", {"seed": 1}, "seed", "seed=1 cannot be used"),
    ("chat/completions", {"stop": ["."]}, "stop", "stop=['.'] cannot be used"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty", "presence_penalty=0.5 cannot be used"),
    ("completions", {"repetition_penalty": 1.2}, "repetition_penalty", "repetition_penalty=1.2 cannot be used"),
    ("completions", {"logit_bias": {"5": 1}}, "logit_bias", "logit_bias={'5': 1.0} cannot be used"),
    ("completions", {"logprobs": 2}, "logprobs", "logprobs cannot be used with use_beam_search=true"),
    ("chat/completions", {"logprobs": True}, "logprobs", "logprobs cannot be used with use_beam_search=true"),
    ("completions", {"n": 65}, "n", "n=65 is too large for beam search: the beam width is at most 64"),
    ("completions", {"n": 3, "best_of": 2}, "n", "n=3 must be <= best_of=2"),
    ("completions", {"early_stopping": "sometimes"}, "early_stopping", "early_stopping"),
    ("completions", {"use_beam_search": False, "length_penalty": 0.5}, "length_penalty",
     "length_penalty=0.5 only applies to beam search; add use_beam_search=true"),
])
def test_fields_that_make_no_sense_with_beams_are_named(server, path, fields, param, message):
    body = {"model": MODEL, "max_tokens": 4, "use_beam_search": True, "n": 2, **fields}
    body.update({"prompt": "Hi"} if path == "completions" else {"messages": QUESTION})
    response = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


LONG_SEARCH = {"model": MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 300, "ignore_eos": True, "use_beam_search": True}


def test_a_client_that_gives_up_on_a_search_frees_every_beam(server):
    wait_for(lambda: server.kv_blocks_in_use() == 0, what="an idle server")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG_SEARCH, timeout=httpx.Timeout(5, read=1.5))
    wait_for(lambda: server.kv_blocks_in_use() == 0, timeout_s=5, what="the abandoned search's blocks to be freed")
    assert server.metrics()["fasterllm_num_requests_running"] == 0


def test_a_forward_pass_failing_mid_search_fails_it_alone(server_in_thread):
    server, client = server_in_thread, server_in_thread.client()
    wait_for(lambda: server.kv_blocks_in_use() == 0, what="an idle server")
    runner = server.llm.engine.executor.runner
    real_execute, calls = runner.execute, []

    def fail_on_the_fourth_step(*args, **kwargs):  # the beams have forked by then
        calls.append(1)
        if len(calls) == 4:
            runner.execute = real_execute
            raise RuntimeError("injected fault")
        return real_execute(*args, **kwargs)

    runner.execute = fail_on_the_fourth_step
    try:
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            client.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=20, timeout=60,
                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    finally:
        runner.execute = real_execute
    wait_for(lambda: server.kv_blocks_in_use() == 0, timeout_s=5, what="the failed search's blocks to be freed")
    assert not server.llm.engine.requests
    reply = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4,
                                      extra_body={"use_beam_search": True})
    assert len(reply.choices) == 2
