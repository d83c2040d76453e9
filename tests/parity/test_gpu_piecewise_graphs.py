"""On a GPU: steps that carry prompt chunks, replayed from piecewise CUDA graphs (worker/piecewise_graphs.py).

A mixed step replayed in pieces must give exactly the logits of the same padded step run eagerly (the same kernels
on the same shapes), and greedy tokens of a staggered batch with chunked prompts must equal transformers' (fp32) and
the eager engine's while the pieces are replayed. Skipped without CUDA."""
from __future__ import annotations

import gc

import pytest
import torch

from fasterllm import LLM
from parity_utils import NEW_TOKENS, TINY_SPECS, first_divergence, hf_greedy, random_prompt, run_staggered
from test_generation import GREEDY, TINY_ARRIVALS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")

PROMPT_LENGTHS = [3, 90, 17, 41, 150]  # chunked by max_num_batched_tokens=48: steps of decodes beside chunks


def engine(directory, utilization: float, **kwargs) -> LLM:
    """Each engine takes a larger share: an earlier one in the process may still hold its cache."""
    return LLM(str(directory), dtype="float32", device="cuda", max_model_len=256, block_size=16,
               max_num_batched_tokens=48, max_num_seqs=4, gpu_memory_utilization=utilization, **kwargs)


@pytest.fixture(scope="module")
def graphs_llm(tiny_checkpoints):
    llm = engine(tiny_checkpoints["llama3_gqa"][0], 0.2)
    yield llm
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_a_mixed_step_replayed_in_pieces_equals_the_eager_pass(graphs_llm):
    runner = graphs_llm.engine.executor.runner
    assert runner.piecewise is not None and sorted(runner.piecewise.captured) == [16, 32, 48]
    # three decodes beside a 29-token chunk whose sequence already holds 8 tokens: 32 rows, the bucket of 32
    query_lens, seq_lens = [1, 1, 1, 29], [12, 30, 5, 37]
    tables = [[1], [2, 3], [4], [5, 6, 7]]
    token_ids = [7, 8, 9] + list(range(10, 39))
    batch = runner.buffers.stage(token_ids, query_lens, seq_lens, tables, [0, 1, 2, 31], padded_tokens=32)
    eager = runner.model(batch.input_ids, batch.meta.positions, runner.kv_caches, batch.meta, batch.logits_indices)
    replayed = runner.piecewise.replay(32, batch.meta.kernel, batch.logits_indices)
    assert torch.equal(replayed, eager)


def test_greedy_tokens_with_piecewise_graphs_match_transformers_and_the_eager_engine(graphs_llm, tiny_checkpoints,
                                                                                    monkeypatch):
    spec = next(s for s in TINY_SPECS if s.name == "llama3_gqa")
    directory, hf_model = tiny_checkpoints["llama3_gqa"]
    prompts = [random_prompt(n, spec.vocab_size, 200 + n) for n in PROMPT_LENGTHS]
    monkeypatch.setattr(hf_model.generation_config, "eos_token_id", None)
    references = [hf_greedy(hf_model, ids, NEW_TOKENS) for ids in prompts]
    piecewise = graphs_llm.engine.executor.runner.piecewise
    replays = []
    monkeypatch.setattr(piecewise, "replay", lambda *args: replays.append(args[0]) or type(piecewise).replay(
        piecewise, *args))
    outputs = run_staggered(graphs_llm.engine, prompts, TINY_ARRIVALS, GREEDY)
    eager = run_staggered(engine(directory, 0.45, enforce_eager=True).engine, prompts, TINY_ARRIVALS, GREEDY)
    assert len(replays) >= 5  # the steps with chunks went through the pieces
    for i, reference in enumerate(references):
        ours = outputs[f"staggered-{i}"]
        assert ours == reference, f"prompt {i}: {first_divergence(ours, reference)}"
        assert eager[f"staggered-{i}"] == ours
