"""An encoder-decoder model (a tiny BART) behind the real server, through the `openai` client: /v1/completions
takes the encoder's input as the prompt, whole and streamed, with usage counting encoder tokens; chat and
oversized inputs get a 400 naming the field."""
from __future__ import annotations

import openai
import pytest
from server_utils import ServerThread

from fasterllm import LLM, SamplingParams

pytest.importorskip("transformers")

TEXT = "w5 w9 w11 w3 w7 w8 w4"
SETTINGS = dict(dtype="float32", device="cpu", num_kv_blocks=64, block_size=8)


@pytest.fixture(scope="module")
def seq2seq_server(tiny_seq2seq):
    from fasterllm.config import EngineArgs
    from fasterllm.engine.async_engine import AsyncLLM

    directory = str(tiny_seq2seq["bart"][0])
    handle = ServerThread(AsyncLLM.from_engine_args(EngineArgs(model=directory, **SETTINGS)))
    yield handle, LLM(directory, **SETTINGS)
    handle.stop()


def test_completions_whole_and_streamed_equal_the_offline_output(seq2seq_server):
    server, offline = seq2seq_server
    client = server.client()
    model = client.models.list().data[0].id
    (expected,) = offline.generate(TEXT, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    reply = client.completions.create(model=model, prompt=TEXT, max_tokens=10, temperature=0)
    assert reply.choices[0].text == expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(expected.encoder_prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)
    stream = client.completions.create(model=model, prompt=TEXT, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(expected.encoder_prompt_token_ids)


def test_chat_and_an_input_past_the_encoder_are_refused_by_field(seq2seq_server):
    server, _ = seq2seq_server
    client = server.client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="encoder-decoder model") as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="encoder takes at most 64 tokens") as info:
        client.completions.create(model=model, prompt=list(range(3, 63)) * 2, max_tokens=4)
    assert info.value.body["param"] == "prompt"
    reply = client.completions.create(model=model, prompt=TEXT, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length"  # the server still answers after refusing those
