"""The server over two engine processes, each with its own copy of SmolLM2 (data parallelism, CPU), through the real
openai client: requests spread over both and answer as one engine does; a replica that dies takes the server's
engine down with its reason instead of leaving requests hanging."""
from __future__ import annotations

import os
import signal
import time

import pytest
from server_utils import SERVER_ENGINE_ARGS, ServerThread, assert_answers_as_one_engine, wait_for
from test_server_robustness import assert_engine_down

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The largest planet is"]


@pytest.fixture
def replicated_server():
    from fasterllm.config import EngineArgs
    from fasterllm.engine.async_engine import AsyncLLM

    handle = ServerThread(AsyncLLM.from_engine_args(EngineArgs(**SERVER_ENGINE_ARGS, data_parallel_size=2)))
    yield handle
    handle.stop()


def test_requests_spread_over_replicas_and_answer_as_one_engine(replicated_server, reference_llm):
    expected = assert_answers_as_one_engine(replicated_server, reference_llm, PROMPTS, max_tokens=12)
    client = replicated_server.client()
    core = replicated_server.llm.core
    assert core.requests_sent == [2, 2]  # four at once: two to each, by load
    assert core.in_flight == [0, 0]
    one_replica = reference_llm.engine.stats().num_kv_blocks
    assert replicated_server.metrics()["fasterllm_kv_cache_blocks"] == 2 * one_replica
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[2], max_tokens=12,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[2]


def test_a_replica_that_dies_takes_the_engine_down_naming_it(replicated_server):
    client = replicated_server.client()
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    assert next(iter(stream)).choices
    core = replicated_server.llm.core
    serving = wait_for(lambda: [i for i, n in enumerate(core.in_flight) if n], what="a replica with the request")[0]
    start = time.time()
    os.kill(core.replicas[serving].process.pid, signal.SIGKILL)
    assert_engine_down(replicated_server, stream, f"replica {serving} of 2: the engine process exited with code -9",
                       start)
