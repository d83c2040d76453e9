"""Disconnects free their requests, engine failures fail only what they must, /metrics counts what happened."""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import ServerThread, wait_for

MODEL = "SmolLM2-135M-Instruct"
LONG_RUN = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def idle(server) -> bool:
    samples = server.metrics()
    return samples["fasterllm_kv_cache_blocks_in_use"] == 0 and samples["fasterllm_num_requests_running"] == 0


def test_a_client_that_disconnects_mid_stream_frees_its_request(server):
    wait_for(lambda: idle(server), what="an idle server")
    aborted = server.metrics()['fasterllm_requests_total{outcome="aborted"}']
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG_RUN, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.kv_blocks_in_use() > 0
    # the connection is closed: the request must be aborted long before its 400 tokens are done
    wait_for(lambda: idle(server), timeout_s=5, what="the disconnected stream's blocks to be freed")
    assert server.metrics()['fasterllm_requests_total{outcome="aborted"}'] == aborted + 1


def test_a_client_that_gives_up_on_a_whole_reply_frees_its_request(server):
    wait_for(lambda: idle(server), what="an idle server")
    generated = server.metrics()["fasterllm_generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG_RUN, timeout=httpx.Timeout(5, read=1.0))
    wait_for(lambda: idle(server), timeout_s=5, what="the abandoned request's blocks to be freed")
    assert server.metrics()["fasterllm_generation_tokens_total"] == generated  # it never finished


def test_a_failing_forward_pass_fails_its_request_with_a_500_and_the_server_recovers(server_in_thread, caplog):
    server = server_in_thread
    runner = server.llm.engine.executor.runner
    real_execute = runner.execute

    def fail_once(*args, **kwargs):
        runner.execute = real_execute
        raise RuntimeError("injected fault")

    client = server.client()
    errors = server.metrics()['fasterllm_requests_total{outcome="error"}']
    runner.execute = fail_once
    try:
        with caplog.at_level(logging.ERROR, logger="fasterllm"):
            with pytest.raises(openai.InternalServerError, match="injected fault") as failure:
                client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    finally:
        runner.execute = real_execute
    request_id = failure.value.body["message"].split("request ")[1].split(":")[0]
    assert request_id.startswith("cmpl-") and request_id in caplog.text
    assert server.metrics()['fasterllm_requests_total{outcome="error"}'] == errors + 1
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).usage.completion_tokens == 4


def test_metrics_count_outcomes_tokens_and_latencies(server, client):
    before = server.metrics()
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                        stream=True, extra_body={"ignore_eos": True}))
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "top_p": 7}).status_code == 400
    after = server.metrics()

    def grew(name: str) -> float:
        return after[name] - before[name]

    assert grew('fasterllm_requests_total{outcome="success"}') == 2
    assert grew('fasterllm_requests_total{outcome="rejected"}') == 1
    assert grew('fasterllm_requests_total{outcome="error"}') == 0
    assert grew("fasterllm_generation_tokens_total") == 5 + 3
    chat_prompt = len(server.llm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
    assert grew("fasterllm_prompt_tokens_total") == reply.usage.prompt_tokens + chat_prompt
    assert grew("fasterllm_time_to_first_token_seconds_count") == 2
    assert grew("fasterllm_time_per_output_token_seconds_count") == 2
    assert grew("fasterllm_time_to_first_token_seconds_sum") > 0
    assert after["fasterllm_kv_cache_blocks"] > 0 and after["fasterllm_num_requests_waiting"] == 0


def tiny_model(directory: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
    from parity_utils import TINY_SPECS, build_tiny_model

    build_tiny_model(TINY_SPECS[0], directory)
    return directory


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A server of its own, on a tiny random-weight model: this one is meant to break."""
    from fasterllm.config import EngineArgs
    from fasterllm.engine.async_engine import AsyncLLM

    directory = tiny_model(tmp_path_factory.mktemp("tiny_llama"))
    handle = ServerThread(AsyncLLM.from_engine_args(EngineArgs(model=str(directory), dtype="float32", device="cpu",
                                                               num_kv_blocks=64), engine_process=False))
    yield handle
    handle.stop()


def test_an_engine_process_that_dies_fails_its_requests_and_reports_unhealthy_without_hanging(tmp_path):
    from fasterllm.config import EngineArgs
    from fasterllm.engine.async_engine import AsyncLLM

    handle = ServerThread(AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model(tmp_path)), dtype="float32",
                                                               device="cpu", num_kv_blocks=64)))
    try:
        client = handle.client()
        name = client.models.list().data[0].id
        stream = client.completions.create(model=name, prompt=[5, 6, 7], max_tokens=250, stream=True,
                                           extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices
        start = time.time()
        os.kill(handle.llm.core.process.pid, signal.SIGKILL)
        assert_engine_down(handle, stream, "engine process exited with code -9", start)
    finally:
        handle.stop()


def test_a_turn_the_server_cannot_take_fails_its_requests_and_reports_unhealthy_without_hanging(tmp_path):
    """A bug on the server's side of the engine process (here its text decoding raising) stops the service the
    way a dead engine does, instead of leaving every request waiting for a reader that has died."""
    from fasterllm.config import EngineArgs
    from fasterllm.engine.async_engine import AsyncLLM

    handle = ServerThread(AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model(tmp_path)), dtype="float32",
                                                               device="cpu", num_kv_blocks=64)))
    try:
        client = handle.client().with_options(timeout=20, max_retries=0)  # a hang fails the test, in 20 s
        name = client.models.list().data[0].id
        stream = client.completions.create(model=name, prompt=[5, 6, 7], max_tokens=250, stream=True,
                                           extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices

        def broken_outputs(encoded):
            raise RuntimeError("text decoding bug")

        handle.llm.core._outputs.outputs = broken_outputs
        assert_engine_down(handle, stream, "text decoding bug", time.time())
    finally:
        handle.stop()


def test_an_engine_that_breaks_reports_unhealthy_and_refuses_without_hanging(tiny_server):
    client = tiny_server.client()
    name = client.models.list().data[0].id
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    stream = client.completions.create(model=name, prompt=[5, 6, 7], max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices

    def broken_schedule():
        raise RuntimeError("scheduler bug")

    tiny_server.llm.engine.scheduler.schedule = broken_schedule  # outside the forward pass: state unknown
    assert_engine_down(tiny_server, stream, "scheduler bug", time.time())


def assert_engine_down(handle, stream, reason: str, since: float) -> None:
    """The stream in flight ends with the reason, /health answers 503 naming it, a new request is refused with 503,
    all within 10 s of `since`."""
    with pytest.raises(openai.APIError, match=reason):
        list(stream)
    health = httpx.get(f"{handle.url}/health")
    assert health.status_code == 503 and reason in health.json()["error"]["message"]
    client = handle.client()
    with pytest.raises(openai.APIStatusError, match="The engine is not running") as refused:
        client.completions.create(model=client.models.list().data[0].id, prompt=[5, 6], max_tokens=2)
    assert refused.value.status_code == 503
    assert time.time() - since < 10
