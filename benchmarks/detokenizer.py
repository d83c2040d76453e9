"""The incremental detokenizer's host time per generated token, as a running request pays it every step: ours from
the tokens' bytes (a byte-level BPE), ours through the tokenizer (each window decoded by `tokenizers`, the path of
every other tokenizer), and `tokenizers`' own DecodeStream (the Rust incremental decoder vLLM's V1 output processor
uses) on the same tokens. SmolLM2's tokenizer (the default model's GGUF), requests of 128 tokens of this project's
README after a 6-token prompt, rounds interleaved.

    python3 benchmarks/detokenizer.py [--rounds 5] [--requests 60]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tokenizers.decoders import DecodeStream

from fasterllm.engine.output_processor import IncrementalDetokenizer
from fasterllm.loader.gguf_checkpoint import GGUFFile
from fasterllm.loader.model_source import default_model_path
from fasterllm.loader.tokenizer import load_gguf_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    tokenizer = load_gguf_tokenizer(GGUFFile(default_model_path()).metadata, [2])
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = ids[:6]
    requests = [ids[i:i + 128] for i in range(6, len(ids) - 128, 128)][:args.requests]
    num_tokens = sum(map(len, requests))

    def ours(from_bytes: bool) -> float:
        start = time.perf_counter()
        for request in requests:
            detokenizer = IncrementalDetokenizer(tokenizer, prompt, True, [], False)
            if not from_bytes:
                detokenizer.pending = None  # every window decoded by the tokenizer
            for token in request:
                detokenizer.add_tokens([token])
        return time.perf_counter() - start

    def decode_stream() -> float:
        start = time.perf_counter()
        for request in requests:
            stream = DecodeStream(skip_special_tokens=True)
            for token in prompt:  # the prompt's tail primes it, as ours
                stream.step(tokenizer.tokenizer, token)
            for token in request:
                stream.step(tokenizer.tokenizer, token)
        return time.perf_counter() - start

    runs = {"ours, from the tokens' bytes": lambda: ours(True), "ours, through the tokenizer": lambda: ours(False),
            "tokenizers' DecodeStream": decode_stream}
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(run() / num_tokens * 1e6)
    print(f"{len(requests)} requests x 128 tokens, SmolLM2's byte-level BPE; us a token, median of {args.rounds} "
          "(each round's)")
    for name, values in times.items():
        print(f"  {name:32s} {statistics.median(values):6.2f}  ({', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
