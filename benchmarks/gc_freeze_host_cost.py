"""What Python's cyclic garbage collector costs the engine's host work, and what freezing the heap saves: in one
process, a tiny model (the matrix products negligible) runs `fasterllm bench`'s loop over N prompts x 32 -> 64 tokens,
outputs every step (a stream) or final only, with the heap frozen while generating (engine/frozen_heap.py) or not,
interleaved over 5 rounds.

    OMP_NUM_THREADS=1 python benchmarks/gc_freeze_host_cost.py DIR N   # DIR: make_random_llama.py --shape llama-tiny
"""
from __future__ import annotations

import statistics
import sys
from contextlib import nullcontext

import fasterllm.bench.offline as offline
from fasterllm.bench.offline import random_prompts, run_engine
from fasterllm.config import EngineArgs
from fasterllm.engine.engine import Engine
from fasterllm.engine.frozen_heap import heap_frozen_while_generating


def main() -> None:
    model, num_prompts = sys.argv[1], int(sys.argv[2])
    engine = Engine(EngineArgs(model=model, dtype="float32", device="cpu", max_num_seqs=256))
    run_engine(engine, random_prompts(engine, 8, 32, seed=99), 8)  # warm-up
    times = {(final_only, frozen): [] for final_only in (False, True) for frozen in (False, True)}
    for round_ in range(5):
        for final_only, frozen in times:
            offline.heap_frozen_while_generating = heap_frozen_while_generating if frozen else nullcontext
            prompts = random_prompts(engine, num_prompts, 32, seed=round_ * 10 + final_only * 2 + frozen)
            times[final_only, frozen].append(run_engine(engine, prompts, 64, final_only=final_only)["seconds"])
    for (final_only, frozen), seconds in times.items():
        print(f"{'final only' if final_only else 'every step'}, heap {'frozen' if frozen else 'not frozen'}: median "
              f"{statistics.median(seconds):.3f} s {[round(s, 3) for s in seconds]}")


if __name__ == "__main__":
    main()
