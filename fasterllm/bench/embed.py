"""`fasterllm bench-embed`: sentences of mixed length through our packed encoder, then through transformers.

The peer is transformers' AutoModel (SDPA attention) on the same weights and dtype, fed padded batches
of --hf-batch-size sentences with an attention mask, pooled as the model asks: once in input order
(what a plain loop does) and once sorted by length first (what sentence-transformers' encode does,
which keeps padding small). Runs are interleaved; medians are reported.
"""
from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fasterllm.config import EngineArgs
from fasterllm.bench.random_encoder import make_random_encoder
from fasterllm.layers.pooling import PoolingConfig
from fasterllm.llm import LLM


def mixed_sentences(vocabulary: list[str], count: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(min_words, max_words))) + "."
            for _ in range(count)]


def word_vocabulary(llm: LLM) -> list[str]:
    """Whole lowercase words of the model's vocabulary: sentences of them tokenize like text."""
    tokenizer = llm.get_tokenizer()
    words = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    return [w for w in words if w and w.isalpha() and w.islower() and len(w) >= 3]


def _hf_pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: PoolingConfig) -> torch.Tensor:
    if pooling.mode == "cls":
        pooled = hidden[:, 0]
    elif pooling.mode == "mean":
        pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
    else:
        raise ValueError(f"the benchmark's transformers peer pools with 'mean' or 'cls', not {pooling.mode!r}")
    return F.normalize(pooled.float(), dim=-1) if pooling.normalize else pooled.float()


def hf_embedder(llm: LLM, batch_size: int, sort_by_length: bool) -> Callable[[list[str]], torch.Tensor]:
    import transformers

    engine = llm.engine
    model = transformers.AutoModel.from_pretrained(engine.source.path, dtype=engine.dtype,
                                                   attn_implementation="sdpa").to(engine.device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(engine.source.path)

    @torch.inference_mode()
    def embed(sentences: list[str]) -> torch.Tensor:
        order = list(range(len(sentences)))
        if sort_by_length:
            order.sort(key=lambda i: len(sentences[i]))
        result = torch.empty(len(sentences), engine.embedding_dim)
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            inputs = tokenizer([sentences[i] for i in chunk], padding=True, truncation=True,
                               max_length=engine.max_model_len, return_tensors="pt").to(engine.device)
            hidden = model(**inputs).last_hidden_state
            result[chunk] = _hf_pool(hidden, inputs["attention_mask"], engine.pooling).cpu()
        result.tolist()  # the same conversion our embed() makes for its outputs
        return result

    return embed


def run_embed_bench(args: EngineArgs, num_sentences: int, min_words: int, max_words: int, repeats: int,
                    with_hf: bool, hf_batch_size: int, seed: int = 0, threads: int | None = None,
                    random_encoder: str | None = None) -> dict[str, float]:
    if threads is not None:  # on a shared CPU, fewer threads than cores avoids waiting on a busy core
        torch.set_num_threads(threads)
    if random_encoder is not None:
        with tempfile.TemporaryDirectory(prefix=f"random-{random_encoder}-") as directory:
            make_random_encoder(Path(directory), random_encoder)
            args = dataclasses.replace(args, model=directory)
            return run_embed_bench(args, num_sentences, min_words, max_words, repeats, with_hf, hf_batch_size, seed)
    llm = LLM(**{**vars(args), "task": "embed"})
    sentences = mixed_sentences(word_vocabulary(llm), num_sentences, min_words, max_words, seed)
    tokens = sum(len(ids) for ids in llm.engine.tokenize(sentences))
    print(f"{llm.engine.model_name}, {str(llm.engine.dtype).removeprefix('torch.')} on {llm.engine.device}, "
          f"torch threads {torch.get_num_threads()}: {num_sentences} sentences of {min_words}-{max_words} words, "
          f"{tokens} tokens (max_num_batched_tokens {llm.engine.max_num_batched_tokens})")

    def ours(batch: list[str]) -> list:  # what a user gets: one output per sentence, its vector a list of floats
        return llm.embed(batch, truncate_prompt_tokens=-1, use_tqdm=False)

    runners: dict[str, Callable[[list[str]], object]] = {"fasterllm": ours}
    if with_hf:
        runners["transformers, input order"] = hf_embedder(llm, hf_batch_size, sort_by_length=False)
        runners["transformers, length-sorted"] = hf_embedder(llm, hf_batch_size, sort_by_length=True)
    return report_interleaved_runs(runners, sentences, repeats, llm.engine.device)


def report_interleaved_runs(runners: dict[str, Callable[[list[str]], object]], sentences: list[str], repeats: int,
                            device: torch.device) -> dict[str, float]:
    """Time each runner on all sentences, interleaved, after a warm-up; print and return sentences/s (medians).
    The first runner is ours; the others get a ratio and the lowest cosine of their vectors against ours."""
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, object] = {}
    for name, run in runners.items():  # warm-up on every batch shape: allocator growth, kernel compiles, graphs
        run(sentences)
    for _ in range(repeats):
        for name, run in runners.items():
            sync(device)
            start = time.perf_counter()
            outputs[name] = run(sentences)
            sync(device)
            seconds[name].append(time.perf_counter() - start)
    ours_name = next(iter(runners))
    vectors = {name: _as_matrix(output) for name, output in outputs.items()}  # outside the timed runs
    results = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        results[name] = len(sentences) / median
        line = f"{name:28s} {results[name]:9.1f} sentences/s  median {median * 1e3:8.1f} ms of {len(times)} runs"
        if name != ours_name:
            cosine = F.cosine_similarity(vectors[ours_name], vectors[name]).min().item()
            line += f"  ours/this {results[ours_name] / results[name]:.2f}x  min cosine {cosine:.6f}"
        print(line + "  runs (s): " + " ".join(f"{t:.2f}" for t in times))
    return results


def _as_matrix(output: object) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return torch.from_numpy(np.array([o.outputs.embedding for o in output], dtype=np.float32))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
