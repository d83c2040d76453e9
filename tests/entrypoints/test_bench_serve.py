"""`fasterllm bench serve` against a real server: every request completes with exactly its output length, from
clients spread over several processes."""
from __future__ import annotations

from fasterllm.bench.serve import run_serve_bench


def test_bench_serve_completes_every_request_from_several_client_processes(server):
    stats = run_serve_bench(server.url, "completions", num_prompts=6, input_len=16, output_len=8, max_concurrency=4,
                            request_rate=float("inf"), client_processes=2)
    assert stats["completed"] == 6 and stats["failed"] == 0
    assert round(stats["output_tokens_per_s"] * stats["seconds"]) == 6 * 8
    assert stats["ttft_p50_ms"] > 0 and stats["itl_p50_ms"] > 0
