"""The server process's CPU time per streamed event over real HTTP, by uvicorn's event loop and HTTP parser: a
stand-in engine core gives every running request one more token each step, clients stream completions over HTTP from
other processes, and the server process reports the CPU time it spent (time.process_time, so a busy machine inflates
the wall time but not this figure) over the events it sent.

    python benchmarks/serving_http_cost.py [--requests 128 --tokens 64 --loop asyncio --http h11]

--loop asyncio / uvloop and --http h11 / httptools pick uvicorn's implementations (uvloop and httptools are
fasterllm dependencies; uvicorn's default, "auto", takes them when installed).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time

_STEP_S = 0.005  # the stand-in engine's step


def serve(port: int, loop: str, http: str, tokens: int, report) -> None:
    import uvicorn

    from fasterllm.engine.async_engine import AsyncLLM
    from fasterllm.engine.engine_loop import AbortRequest, AddRequest, Turn
    from fasterllm.entrypoints.openai.server import build_app
    from serving_frontend import output_after

    class StandInCore:
        """Accepts every request; each step gives every running request one more token until it has `tokens`."""
        model_name, max_model_len, tokenizer, stats, alive = "m", 4096, None, None, True

        def __init__(self) -> None:
            self.running: dict[str, int] = {}
            self.events = 0
            self.cpu_start: float | None = None

        def start(self, on_turn):
            self.on_turn = on_turn
            asyncio.get_running_loop().create_task(self.steps())

        def shutdown(self, timeout_s):
            return None

        def send(self, command):
            if isinstance(command, AddRequest):
                self.running[command.request_id] = 0
                self.on_turn(Turn(accepted=[(command.request_id, None)]))
                if self.cpu_start is None:
                    self.cpu_start = time.process_time()
            elif isinstance(command, AbortRequest):  # applied at once, as the engine loop's next turn says
                self.running.pop(command.request_id, None)
                asyncio.get_running_loop().call_soon(self.on_turn, Turn(aborted=[command.request_id]))

        async def steps(self):
            while True:
                await asyncio.sleep(_STEP_S)
                outputs = []
                for request_id in list(self.running):
                    made = self.running[request_id] = self.running[request_id] + 1
                    done = made == tokens
                    outputs.append((request_id, output_after(request_id, made, done)))
                    if done:
                        del self.running[request_id]
                self.events += len(outputs)
                if outputs:
                    self.on_turn(Turn(outputs=outputs))

    class Inputs:  # the prompt checks a completion request passes through
        seq2seq = None

        def generation_prompts(self, prompt):
            return [prompt]

        def check_generation_length(self, *args):
            return None

    core = StandInCore()
    core.inputs = Inputs()
    llm = AsyncLLM(core)
    app = build_app(llm, "m", None, None)

    @app.get("/cost")
    def cost():
        return {"cpu_s": time.process_time() - core.cpu_start, "events": core.events}

    report.put("ready")
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop=loop, http=http)).run()


async def stream_all(port: int, requests: int, tokens: int) -> int:
    import httpx

    chunks = 0
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        async def one() -> None:
            nonlocal chunks
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": tokens, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    chunks += line.startswith("data: {")

        await asyncio.gather(*(one() for _ in range(requests)))
    return chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"])
    parser.add_argument("--http", default="h11", choices=["h11", "httptools"])
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    server = context.Process(target=serve, args=(args.port, args.loop, args.http, args.tokens, ready), daemon=True)
    server.start()
    ready.get(timeout=60)
    time.sleep(1.0)  # uvicorn binds after the app is built
    try:
        start = time.perf_counter()
        chunks = asyncio.run(stream_all(args.port, args.requests, args.tokens))
        wall = time.perf_counter() - start
        import httpx

        cost = httpx.get(f"http://127.0.0.1:{args.port}/cost").json()
    finally:
        server.terminate()
    print(json.dumps({"loop": args.loop, "http": args.http, "requests": args.requests, "tokens": args.tokens,
                      "chunks_received": chunks, "wall_s": round(wall, 2),
                      "server_cpu_us_per_event": round(1e6 * cost["cpu_s"] / max(cost["events"], 1), 1)}))


if __name__ == "__main__":
    main()
