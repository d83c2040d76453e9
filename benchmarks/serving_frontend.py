"""The server process's own cost per streamed event, without HTTP: N requests stream completions from a stand-in
engine core (every step gives each request one more token), through the completions endpoint's chunks and the
server-sent events. Streams of one prompt (read directly) beside streams of two prompts (merged through a queue).

    python benchmarks/serving_frontend.py [--requests 256 --steps 50]
"""
from __future__ import annotations

import argparse
import asyncio
import time

from fasterllm.engine.async_engine import AsyncLLM
from fasterllm.engine.engine_loop import AbortRequest, AddRequest, Turn
from fasterllm.entrypoints.openai.metrics import ServerMetrics
from fasterllm.entrypoints.openai.protocol import CompletionRequest
from fasterllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fasterllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fasterllm.sampling_params import SamplingParams


def output_after(request_id: str, made: int, done: bool) -> RequestOutput:
    """A stand-in engine's output of a request that has made `made` tokens (two characters of text each)."""
    return RequestOutput(request_id, None, [1], [CompletionOutput(0, "ab" * made, list(range(made)), None, None,
                                                                  "length" if done else None)], done,
                         RequestMetrics(0.0, 0.0, 0.0, 0.0))


class StandInCore:
    """Accepts every request at once; the benchmark hands out the outputs."""
    model_name, max_model_len, tokenizer, inputs, stats, alive = "m", 4096, None, None, None, True

    def start(self, on_turn):
        self.on_turn = on_turn

    def send(self, command):
        if isinstance(command, AddRequest):
            asyncio.get_running_loop().call_soon(self.on_turn, Turn(accepted=[(command.request_id, None)]))
        elif isinstance(command, AbortRequest):  # applied at once, as the engine loop's next turn says
            asyncio.get_running_loop().call_soon(self.on_turn, Turn(aborted=[command.request_id]))


async def events_per_request_stream(num_requests: int, steps: int, prompts_per_stream: int) -> float:
    """Microseconds per server-sent event."""
    core = StandInCore()
    llm = AsyncLLM(core)
    llm.start()
    serving = OpenAIServingCompletion(llm, "m", ServerMetrics())
    request = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=steps, stream=True)
    streams = [[f"s{i}-{j}" for j in range(prompts_per_stream)] for i in range(num_requests // prompts_per_stream)]
    for ids in streams:
        for request_id in ids:
            await llm.add_request(request_id, [1], SamplingParams(max_tokens=steps))
    events = 0

    async def consume(ids: list[str]) -> None:
        nonlocal events
        async for _ in serving._sse(ids[0], serving._chunks(request, ids[0], 0, ids)):
            events += 1

    tasks = [asyncio.create_task(consume(ids)) for ids in streams]
    await asyncio.sleep(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        done = step == steps
        core.on_turn(Turn(outputs=[(rid, output_after(rid, step, done)) for ids in streams for rid in ids]))
        for _ in range(4):  # let every consumer take the step's output before the next
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (time.perf_counter() - start) / events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    for prompts in (1, 2):
        per_event = asyncio.run(events_per_request_stream(args.requests, args.steps, prompts))
        print(f"{args.requests} requests in streams of {prompts} prompt(s), {args.steps} steps: "
              f"{per_event:.1f} us per event")


if __name__ == "__main__":
    main()
