"""The server over a model sharded across worker processes (SmolLM2 over 3 ranks, gloo on the CPU), through the real
openai client: answers equal the one-process engine's, streamed or not."""
from __future__ import annotations

import pytest
from server_utils import SERVER_ENGINE_ARGS, ServerThread, assert_answers_as_one_engine

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def sharded_server():
    from fasterllm.config import EngineArgs
    from fasterllm.engine.async_engine import AsyncLLM

    handle = ServerThread(AsyncLLM.from_engine_args(EngineArgs(**SERVER_ENGINE_ARGS, tensor_parallel_size=3)))
    yield handle
    handle.stop()  # the engine process stops its worker processes


def test_sharded_server_answers_as_one_process(sharded_server, reference_llm):
    expected = assert_answers_as_one_engine(sharded_server, reference_llm, PROMPTS, max_tokens=16)
    client = sharded_server.client()
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=16,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[0]
