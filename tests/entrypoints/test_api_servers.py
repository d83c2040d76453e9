"""`fasterllm serve --api-server-count 2` as a user runs it: two HTTP server processes in front of one engine process.
Concurrent streams through the real openai client answer as the offline engine does, /metrics adds up both
processes, an engine that dies is reported by the API servers, an API server that dies stops the whole, and SIGTERM
lets the stream in flight finish and leaves no process behind."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import SERVER_ENGINE_ARGS, free_port, metric_samples

from fasterllm import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(12)]


class Served:
    """`fasterllm serve --api-server-count 2` in a process of its own, with the pids its log names."""

    def __init__(self):
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.process, self.api_servers, self.engine = None, [], None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = SERVER_ENGINE_ARGS
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fasterllm.entrypoints.cli", "serve", "--port", str(self.port),
             "--api-server-count", "2", "--dtype", args["dtype"], "--cpu-kv-cache-gib", str(args["cpu_kv_cache_gib"]),
             "--max-model-len", str(args["max_model_len"]), "--shutdown-timeout", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        serving = threading.Event()

        def read() -> None:
            for line in self.process.stdout:
                self.log.append(line)
                if "API server processes" in line:
                    serving.set()

        threading.Thread(target=read, daemon=True).start()
        assert serving.wait(180), f"the server did not start in 180 s: {''.join(self.log)}"
        found = re.search(r"from 2 API server processes \(pids (\d+), (\d+); engine process: pid (\d+)\)",
                          "".join(self.log))
        self.api_servers, self.engine = [int(found[1]), int(found[2])], int(found[3])
        deadline = time.time() + 60
        while not self._healthy():
            assert self.process.poll() is None and time.time() < deadline, "".join(self.log)
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:  # connections wait in the socket's queue until an API server has started
            return httpx.get(self.url + "/health", timeout=60).status_code == 200
        except httpx.TransportError:
            return False

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def children_alive(self) -> list[int]:
        return [pid for pid in [*self.api_servers, self.engine] if pid is not None and _alive(pid)]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in self.children_alive():
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def served():
    handle = Served()
    yield handle
    handle.stop()


def _streams(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Every prompt streamed at once, each on a connection of its own."""
    async def run() -> list[str]:
        async def one(prompt: str) -> str:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                         temperature=0, stream=True)
                return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        return await asyncio.gather(*(one(prompt) for prompt in prompts))
    return asyncio.run(run())


def test_concurrent_streams_answer_as_one_engine_and_metrics_add_up_both_servers(served, reference_llm):
    reference = reference_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert _streams(served.url, PROMPTS, max_tokens=16) == [o.outputs[0].text for o in reference]
    metrics = metric_samples(httpx.get(served.url + "/metrics").text)  # whichever process answers counts both
    assert metrics['fasterllm_requests_total{outcome="success"}'] == len(PROMPTS)
    assert metrics["fasterllm_generation_tokens_total"] == sum(len(o.outputs[0].token_ids) for o in reference)
    assert metrics["fasterllm_kv_cache_blocks"] == reference_llm.engine.stats().num_kv_blocks

    # the engine process dies while requests keep coming: every API server says so, none hangs, and the starter
    # stays to say it
    stream = served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, stream=True,
                                                extra_body={"ignore_eos": True})
    assert next(iter(stream)).choices
    keep_asking = threading.Event()
    answers: list[int] = []

    def ask() -> None:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=20)
        while not keep_asking.is_set():
            try:
                client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2)
                answers.append(200)
            except openai.APIStatusError as error:
                answers.append(error.status_code)
    askers = [threading.Thread(target=ask) for _ in range(4)]
    for asker in askers:
        asker.start()
    time.sleep(0.5)
    os.kill(served.engine, signal.SIGKILL)
    reason = "the engine process exited with code -9"
    with pytest.raises(openai.APIError, match=reason):
        list(stream)
    time.sleep(1)
    keep_asking.set()
    for asker in askers:
        asker.join(30)
        assert not asker.is_alive(), "a request hung after the engine died"
    assert answers[-1] == 503
    for _ in range(8):  # new connections, answered by either API server
        health = httpx.get(served.url + "/health", headers={"connection": "close"}, timeout=10)
        assert health.status_code == 503 and reason in health.json()["error"]["message"]
    assert served.process.poll() is None


def test_metrics_add_up_every_api_server_process(tmp_path):
    """Two API server processes each count requests and tokens; a third renders the sums (whichever process a
    scrape reaches)."""
    count = ("from fasterllm.entrypoints.openai.metrics import ServerMetrics; m = ServerMetrics(); "
             "m.requests.labels('success').inc({n}); m.generation_tokens.inc({n} * 10)")
    render = ("import sys; from fasterllm.engine.engine_stats import EngineStats; "
              "from fasterllm.entrypoints.openai.metrics import ServerMetrics; "
              "sys.stdout.write(ServerMetrics().render(EngineStats(*[7] * 4, 20, *[0] * 6)).decode())")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for n in (3, 4):
        subprocess.run([sys.executable, "-c", count.format(n=n)], env=env, check=True)
    text = subprocess.run([sys.executable, "-c", render], env=env, check=True, capture_output=True, text=True).stdout
    samples = metric_samples(text)
    assert samples['fasterllm_requests_total{outcome="success"}'] == 7
    assert samples["fasterllm_generation_tokens_total"] == 70
    assert samples["fasterllm_kv_cache_blocks"] == 20


def test_a_signal_during_the_load_stops_everything_at_once():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fasterllm.entrypoints.cli", "serve", "--port", str(port),
                                "--api-server-count", "2", "--dtype", "float32"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children = []
    try:
        deadline = time.time() + 60
        while len(children) < 2:  # multiprocessing's resource tracker and the engine process, loading
            assert time.time() < deadline and process.poll() is None, process.stdout.read()
            time.sleep(0.05)
            children = _children(process.pid)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 130
        assert "API server processes" not in process.stdout.read()  # it stopped before any started
        deadline = time.time() + 10
        while [pid for pid in children if _alive(pid)]:
            assert time.time() < deadline, f"left running: {[pid for pid in children if _alive(pid)]}"
            time.sleep(0.1)
    finally:
        for pid in [process.pid, *children]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_an_api_server_that_dies_stops_the_server(served):
    os.kill(served.api_servers[1], signal.SIGKILL)
    assert served.process.wait(60) == 1
    assert f"API server process 1 exited with code -{signal.SIGKILL}" in "".join(served.log)
    deadline = time.time() + 30
    while served.children_alive():
        assert time.time() < deadline, f"still running: {served.children_alive()}"
        time.sleep(0.2)


def test_sigterm_lets_the_stream_in_flight_finish_and_leaves_no_process(served):
    stream = served.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=48, stream=True,
                                                extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    served.process.send_signal(signal.SIGTERM)
    chunks.extend(stream)
    assert sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].text) >= 40
    assert chunks[-1].choices[0].finish_reason == "length"
    assert served.process.wait(60) == 0
    assert served.children_alive() == []


def test_settings_it_cannot_take_are_refused_naming_them():
    from fasterllm.config import EngineArgs
    from fasterllm.entrypoints.openai.server import ServeOptions, run_server

    with pytest.raises(ValueError, match="--api-server-count 0: must be 1 or more"):
        run_server(EngineArgs(device="cpu"), ServeOptions(api_server_count=0))
    with pytest.raises(ValueError, match="--api-server-count 2 with --data-parallel-size 2.*use one of the two"):
        run_server(EngineArgs(device="cpu", data_parallel_size=2), ServeOptions(api_server_count=2))
    with pytest.raises(ValueError, match="--api-server-count 2 with --embedding-model.*--api-server-count 1"):
        run_server(EngineArgs(device="cpu"), ServeOptions(api_server_count=2, embedding_model="default"))
