"""The same Engine and workload, stepped from the main thread and from a fresh thread, interleaved.

    python benchmarks/thread_main_vs_background.py

Found while measuring the server (issue 4): on the shared 2-core CPU the server, which steps its
engine from a background thread, was several times faster than `fasterllm bench` on the same workload.
"""
import threading

from fasterllm.bench.offline import random_prompts, run_engine
from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine

engine = Engine(EngineArgs())
run_engine(engine, random_prompts(engine, 1, 8, seed=99), 4)  # warm-up


def once(seed: int) -> str:
    r = run_engine(engine, random_prompts(engine, 16, 128, seed=seed), 32)
    return f"tok/s {r['output_tokens_per_s']:.1f} TTFT {r['ttft_median_ms']:.0f} ms TPOT {r['tpot_median_ms']:.1f} ms"


for repeat in range(2):
    print("main thread      ", once(repeat * 2), flush=True)
    result = []
    worker = threading.Thread(target=lambda: result.append(once(repeat * 2 + 1)))
    worker.start()
    worker.join()
    print("background thread", result[0], flush=True)
