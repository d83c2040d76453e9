"""`fasterllm bench serve`: streaming requests against a running OpenAI-compatible server (ours or vLLM's).

Each request streams its tokens; the client notes when every chunk arrives. Time to first token
(TTFT) runs from sending the request to its first text; inter-token latency (ITL) is the gap
between text chunks: one per generated token while the server keeps up; a server that falls behind (ours, vLLM's)
sends the tokens it has in one chunk. Clients are threads on the
standard library's http.client, so the benchmark needs nothing beyond Python; for many clients they are spread
over several processes, so that parsing the streams does not bound what the benchmark can see.
"""
from __future__ import annotations

import http.client
import itertools
import json
import math
import multiprocessing
import os
import random
import statistics
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fasterllm.bench.sharegpt_like import sharegpt_like_lengths
from fasterllm.bench.stats import percentile

# random prompt token ids are drawn from this range: above the special tokens and below the vocabulary
# size of every model family we serve (SmolLM2 49152, Llama 3 128256, Qwen2 151936)
_RANDOM_TOKEN_IDS = (1000, 30000)


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)


def _post_stream(base: urllib.parse.SplitResult, path: str, body: dict, headers: dict[str, str],
                 chat: bool) -> RequestResult:
    conn_type = http.client.HTTPSConnection if base.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(base.hostname, base.port, timeout=600)
    try:
        start = time.perf_counter()
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            return RequestResult(False, f"HTTP {response.status}: {response.read()[:300].decode(errors='replace')}")
        result, last = RequestResult(True), None
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return RequestResult(False, chunk["error"].get("message", str(chunk)))
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or [{}]
            text = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
            if text:
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.chunk_gaps_s.append(now - last)
                last = now
        result.latency_s = time.perf_counter() - start
        return result
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return RequestResult(False, repr(exc))
    finally:
        conn.close()


def _served_model(base: urllib.parse.SplitResult, headers: dict[str, str]) -> str:
    conn = http.client.HTTPConnection(base.hostname, base.port, timeout=30)
    try:
        conn.request("GET", base.path.rstrip("/") + "/v1/models", headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            raise ValueError(f"GET /v1/models answered HTTP {response.status}; is --base-url a fasterllm server "
                             "(and --api-key right)?")
        return json.loads(response.read())["data"][0]["id"]
    except OSError as exc:
        raise ValueError(f"no server answers at {base.geturl()} ({exc}); start one with `fasterllm serve`") from None
    finally:
        conn.close()


def run_serve_bench(base_url: str, endpoint: str, num_prompts: int, input_len: int, output_len: int,
                    max_concurrency: int, request_rate: float, api_key: str | None = None,
                    model: str | None = None, seed: int = 0, sharegpt_like: bool = False,
                    client_processes: int | None = None) -> dict[str, float]:
    """Send num_prompts streaming requests; print and return throughput and latency percentiles.

    sharegpt_like: each request's prompt and output lengths from bench/sharegpt_like.py (drawn with this seed, as
    `fasterllm bench --sharegpt-like` draws its first run's); client_processes: how many processes share the clients
    (default: one per 32 clients, at most half the CPUs)."""
    if min(num_prompts, input_len, output_len, max_concurrency) < 1 or request_rate <= 0:
        raise ValueError(f"num_prompts={num_prompts}, input_len={input_len}, output_len={output_len}, "
                         f"max_concurrency={max_concurrency} must all be >= 1 and request_rate={request_rate} > 0")
    processes = client_processes or max(1, min((os.cpu_count() or 2) // 2, math.ceil(max_concurrency / 32)))
    if not 1 <= processes <= max_concurrency:
        raise ValueError(f"client_processes={processes} must be between 1 and max_concurrency={max_concurrency}")
    base = urllib.parse.urlsplit(base_url)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    model = model or _served_model(base, headers)
    rng = random.Random(seed)
    chat = endpoint == "chat"
    path = base.path.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    input_lens, output_lens = (sharegpt_like_lengths(num_prompts, seed) if sharegpt_like
                               else ([input_len] * num_prompts, [output_len] * num_prompts))
    bodies = []
    for prompt_len, max_tokens in zip(input_lens, output_lens):
        prompt = [rng.randrange(*_RANDOM_TOKEN_IDS) for _ in range(prompt_len)]
        body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if chat:  # random words: a chat message is text, so its length in tokens is about input_len
            body["messages"] = [{"role": "user", "content": " ".join(f"w{t}" for t in prompt[:max(1, prompt_len // 3)])}]
        else:
            body["prompt"] = prompt
        bodies.append(body)
    offsets = [0.0] * num_prompts  # when each request is sent, from the start
    if request_rate != float("inf"):
        offsets = list(itertools.accumulate(rng.expovariate(request_rate) for _ in bodies))

    context = multiprocessing.get_context("spawn")  # not fork: the caller may hold threads (a server in a test)
    ready = context.Barrier(processes + 1)
    results = context.Queue()
    shares = [(bodies[i::processes], offsets[i::processes], len(range(i, max_concurrency, processes)))
              for i in range(processes)]
    workers = [context.Process(target=_client_process, args=(base_url, path, share, share_offsets, clients, headers,
                                                             chat, ready, results), daemon=True)
               for share, share_offsets, clients in shares]
    for worker in workers:
        worker.start()
    ready.wait()  # every client process is up: their start-up is not timed
    start = time.perf_counter()
    collected = [result for _ in workers for result in results.get()]
    elapsed = time.perf_counter() - start
    for worker in workers:
        worker.join()
    return _report(collected, elapsed, num_prompts, max_concurrency, request_rate)


def _client_process(base_url: str, path: str, bodies: list[dict], offsets: list[float], clients: int,
                    headers: dict[str, str], chat: bool, ready, results) -> None:
    """Send these requests from `clients` threads, each when its offset has passed; put the results on the queue."""
    base = urllib.parse.urlsplit(base_url)
    done: list[RequestResult] = []
    lock = threading.Lock()

    def send(body: dict) -> None:
        result = _post_stream(base, path, body, headers, chat)
        with lock:
            done.append(result)

    ready.wait()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        for body, offset in zip(bodies, offsets):
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            pool.submit(send, body)
    results.put(done)


def _report(results: list[RequestResult], elapsed: float, num_prompts: int, max_concurrency: int,
            request_rate: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    ttft = [r.ttft_s for r in done]
    itl = [gap for r in done for gap in r.chunk_gaps_s]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in done)
    stats = {"seconds": elapsed, "completed": len(done), "failed": len(failed),
             "requests_per_s": len(done) / elapsed, "output_tokens_per_s": output_tokens / elapsed,
             "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
             "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
             "tpot_median_ms": 1e3 * statistics.median(tpot) if tpot else float("nan")}
    print(f"{num_prompts} requests, max concurrency {max_concurrency}, request rate {request_rate}/s: "
          f"{len(done)} completed, {len(failed)} failed in {elapsed:.2f} s")
    for r in failed[:3]:
        print(f"  failed: {r.error}")
    print(f"requests/s         : {stats['requests_per_s']:.2f}")
    print(f"output tokens/s    : {stats['output_tokens_per_s']:.1f}")
    print(f"TTFT p50 / p99     : {stats['ttft_p50_ms']:.1f} / {stats['ttft_p99_ms']:.1f} ms")
    print(f"ITL  p50 / p99     : {stats['itl_p50_ms']:.1f} / {stats['itl_p99_ms']:.1f} ms")
    print(f"TPOT median        : {stats['tpot_median_ms']:.1f} ms")
    return stats
