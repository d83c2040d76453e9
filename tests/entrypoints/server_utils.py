"""Helpers for the server tests: a real server on 127.0.0.1 in a thread, /metrics parsing, waiting.

The server runs in a thread of the test process (uvicorn + AsyncLLM, as `fasterllm serve` runs
them), so a test can also reach its engine, e.g. to make a forward pass fail.
"""
from __future__ import annotations

import socket
import threading
import time

import httpx

# fp32: greedy output is then exactly independent of the batch (bf16 only up to near-ties)
SERVER_ENGINE_ARGS = dict(dtype="float32", device="cpu", cpu_kv_cache_gib=0.2, max_model_len=512)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, llm, **app_kwargs):
        import uvicorn

        from fasterllm.entrypoints.openai.server import build_app

        self.llm = llm
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(llm, **app_kwargs), host="127.0.0.1", port=self.port,
                                                    log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "the server did not start"
            time.sleep(0.05)

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)

    def kv_blocks_in_use(self) -> float:
        return self.metrics()["fasterllm_kv_cache_blocks_in_use"]

    def metrics(self) -> dict[str, float]:
        return metric_samples(httpx.get(self.url + "/metrics").text)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus' text format (what /metrics answers) as {'name{labels}': value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def dummy_generator():
    """An AsyncLLM for a server whose generation is not under test: the default model's shape with random weights,
    which load in a moment."""
    from fasterllm.config import EngineArgs
    from fasterllm.engine.async_engine import AsyncLLM
    from fasterllm.loader.model_source import default_model_path

    return AsyncLLM.from_engine_args(EngineArgs(model=str(default_model_path()), load_format="dummy", dtype="float32",
                                                device="cpu", cpu_kv_cache_gib=0.05, max_model_len=128))


def wait_for(condition, timeout_s: float = 30.0, what: str = "the condition"):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def assert_answers_as_one_engine(handle, reference_llm, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy completions of all prompts in one request equal the offline engine's; returns those texts."""
    from fasterllm import SamplingParams

    expected = [o.outputs[0].text for o in reference_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)]
    answers = handle.client().completions.create(model="SmolLM2-135M-Instruct", prompt=prompts,
                                                 max_tokens=max_tokens, temperature=0)
    assert [choice.text for choice in sorted(answers.choices, key=lambda c: c.index)] == expected
    return expected
