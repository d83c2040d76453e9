"""`fasterllm serve` as a user runs it: a process with --api-key and --embedding-model, stopped by SIGTERM with a
request in flight."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_utils import free_port, wait_for

from fasterllm import LLM

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served():
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fasterllm.entrypoints.cli", "serve", "--port", str(port), "--api-key", "sesame",
         "--served-model-name", "smol", "--dtype", "float32", "--cpu-kv-cache-gib", "0.1", "--max-model-len", "512",
         "--shutdown-timeout", "60", "--embedding-model", "default"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert process.poll() is None, process.stdout.read()
        assert time.time() < deadline, "the server did not start in 120 s"
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.ConnectError:
            time.sleep(0.2)
    yield process, url
    if process.poll() is None:
        process.kill()
        process.wait()


def test_api_key_is_required_under_v1(served):
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Missing or wrong API key"):
        client.models.list()
    no_key = httpx.post(url + "/v1/completions", json={"prompt": "Hi"})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "AuthenticationError"
    client = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smol", "all-MiniLM-L6-v2"]
    reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert reply.model == "smol" and reply.usage.completion_tokens <= 3
    assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open for probes


def test_embeddings_equal_the_offline_api_while_a_generation_streams(served):
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
    reference = LLM(task="embed", dtype="float32", device="cpu")
    texts = ["A man is eating food.", "The girl is carrying a baby.", "hi"]
    expected = torch.tensor([o.outputs.embedding for o in reference.embed(texts, use_tqdm=False)])
    token_ids = reference.get_tokenizer().encode(texts[0])
    generation = dict(model="smol", prompt="Once upon a time", max_tokens=30, temperature=0,
                      extra_body={"ignore_eos": True})
    stream = client.completions.create(stream=True, **generation)
    chunks = [next(iter(stream))]

    def embed(value, **kwargs) -> torch.Tensor:
        response = client.embeddings.create(model="all-MiniLM-L6-v2", input=value, **kwargs)
        assert response.model == "all-MiniLM-L6-v2"
        assert [d.index for d in response.data] == list(range(len(response.data)))
        return torch.tensor([d.embedding for d in response.data])

    # float32 on both sides, in two processes: equal up to the order of float sums
    close = dict(atol=1e-6, rtol=0)
    torch.testing.assert_close(embed(texts[0], encoding_format="float"), expected[:1], **close)
    torch.testing.assert_close(embed(texts), expected, **close)  # the client asks for base64 and decodes it
    torch.testing.assert_close(embed(texts, encoding_format="float"), expected, **close)
    torch.testing.assert_close(embed(token_ids, encoding_format="float"), expected[:1], **close)
    torch.testing.assert_close(embed([token_ids, token_ids]), expected[[0, 0]], **close)
    usage = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts).usage
    assert usage.prompt_tokens == sum(len(reference.get_tokenizer().encode(t)) for t in texts)
    with pytest.raises(openai.BadRequestError, match="input 1: the text is empty"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=["ok", ""])
    with pytest.raises(openai.NotFoundError, match="its embeddings model is 'all-MiniLM-L6-v2'"):
        client.embeddings.create(model="smol", input="hi")
    not_json = httpx.post(url + "/v1/embeddings", content=b"{not json", headers={"Authorization": "Bearer sesame"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    chunks.extend(stream)  # the generation went on beside the embeddings
    assert "".join(c.choices[0].text for c in chunks) == client.completions.create(**generation).choices[0].text


def test_sigterm_finishes_the_request_in_flight_then_refuses_new_ones_and_exits(served):
    process, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
    stream = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=60, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    engine_processes = engine_processes_of(process.pid)
    assert len(engine_processes) == 1  # `fasterllm serve` runs its engine in a process of its own
    process.send_signal(signal.SIGTERM)
    chunks.extend(stream)
    assert chunks[-1].usage.completion_tokens == 60
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")
    # uvicorn re-raises the SIGTERM once it has shut down cleanly, so the exit status says "terminated"
    assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    log = process.stdout.read()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert not Path(f"/proc/{engine_processes[0]}").exists()  # stopped with the server, not left behind


def test_the_engine_process_exits_when_the_server_is_killed():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fasterllm.entrypoints.cli", "serve", "--port", str(port),
                                "--load-format", "dummy", "--cpu-kv-cache-gib", "0.05", "--max-model-len", "128"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = wait_for(lambda: engine_processes_of(process.pid), timeout_s=60, what="the engine process")[0]
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/health"), timeout_s=120, what="the server")
    finally:
        process.kill()  # no shutdown: the engine process must notice by itself
        process.wait()
    wait_for(lambda: not Path(f"/proc/{engine}").exists(), timeout_s=10, what="the orphaned engine process to exit")


def engine_processes_of(pid: int) -> list[int]:
    """The process's children started by multiprocessing's spawn (not its resource tracker)."""
    children = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [child for child in children if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.ConnectError:
        return False
