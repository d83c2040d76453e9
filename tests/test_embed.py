"""LLM(task="embed").embed(): order, batching by token budget, truncation, and errors a user meets."""
from __future__ import annotations

import re

import pytest
import torch

from fasterllm import LLM
from fasterllm.config import EngineArgs


@pytest.fixture(scope="module")
def llm():
    return LLM(task="embed", dtype="float32", device="cpu")


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_embed_returns_one_unit_vector_per_input_in_order(llm):
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is eating food."]
    outputs = llm.embed(texts, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [llm.get_tokenizer().encode(t) for t in texts]
    vectors = _vectors(outputs)
    assert vectors.shape == (4, 384) and outputs[0].outputs.hidden_size == 384
    torch.testing.assert_close(vectors[0], vectors[3])
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > similarity[0, 2] + 0.3  # the two sentences about eating are the close pair
    token_input = llm.embed({"prompt_token_ids": outputs[1].prompt_token_ids}, use_tqdm=False)
    torch.testing.assert_close(_vectors(token_input)[0], vectors[1])


def test_small_token_budget_splits_batches_without_changing_vectors(llm):
    small = LLM(task="embed", dtype="float32", device="cpu", max_num_batched_tokens=256)
    texts = [" ".join(["word"] * n) for n in (1, 30, 200, 5, 90, 60, 250)]
    seen_batches = []
    embed_batch = small.engine.runner.embed
    small.engine.runner.embed = lambda ids: seen_batches.append([len(s) for s in ids]) or embed_batch(ids)
    chunked = _vectors(small.embed(texts, use_tqdm=False))
    assert len(seen_batches) > 1 and all(sum(batch) <= 256 for batch in seen_batches)
    assert sorted(n for batch in seen_batches for n in batch) == sorted(len(ids) for ids in
                                                                       small.engine.tokenize(texts))
    torch.testing.assert_close(chunked, _vectors(llm.embed(texts, use_tqdm=False)), atol=1e-5, rtol=1e-5)


def test_over_long_input_is_refused_or_truncated_as_asked(llm):
    long_text = "one two three " * 200
    with pytest.raises(ValueError, match=r"input 0: the input has \d+ tokens but max_model_len is 256.*"
                                         "truncate_prompt_tokens=-1"):
        llm.embed(long_text)
    kept = llm.embed(long_text, truncate_prompt_tokens=-1, use_tqdm=False)[0].prompt_token_ids
    assert len(kept) == 256 and kept[0] == 101 and kept[-1] == 102  # [CLS] ... [SEP] kept around the tail
    assert kept[1:-1] == llm.get_tokenizer().encode(long_text, add_special_tokens=False)[-254:]
    assert len(llm.embed(long_text, truncate_prompt_tokens=10, use_tqdm=False)[0].prompt_token_ids) == 10
    ids = list(range(1000, 1300))
    assert llm.embed([ids], truncate_prompt_tokens=100, use_tqdm=False)[0].prompt_token_ids == ids[-100:]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=1000 must be -1 .* \[1, max_model_len=256\]"):
        llm.embed("short", truncate_prompt_tokens=1000)
    with pytest.raises(ValueError, match="truncate_prompt_tokens=2 leaves no room"):
        llm.embed("short", truncate_prompt_tokens=2)


@pytest.mark.parametrize("inputs, message", [
    ([], "embed\\(\\) got no inputs"),
    ("", "input 0: the text is empty"),
    (["fine", ""], "input 1: the text is empty"),
    ([[]], "input 0: the input has no tokens"),
    ([[101, 40000]], r"input 0: token ids \[40000\] are not valid: ids must be integers in \[0, 30522\)"),
])
def test_bad_inputs_get_clear_errors(llm, inputs, message):
    with pytest.raises(ValueError, match=message):
        llm.embed(inputs)


def test_tasks_are_kept_apart(llm):
    with pytest.raises(ValueError, match="task='embed'.*use embed\\(\\)"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match="task='bogus' is not supported"):
        EngineArgs(task="bogus").validate()
    with pytest.raises(ValueError, match="max_model_len=600 exceeds the model's 512 positions"):
        LLM(task="embed", max_model_len=600)


def test_cli_embed_prints_one_json_vector_per_text(llm, capsys):
    import json

    from fasterllm.entrypoints.cli import main

    assert main(["embed", "A man is eating food.", "hi", "--dtype", "float32", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = [o.outputs.embedding for o in llm.embed(["A man is eating food.", "hi"], use_tqdm=False)]
    assert torch.allclose(torch.tensor([json.loads(line) for line in lines]), torch.tensor(expected), atol=1e-6)
    assert main(["embed", "", "--device", "cpu"]) == 2
    assert "input 0: the text is empty" in capsys.readouterr().err


def test_bench_embed_runs_both_sides_on_the_same_sentences(capsys):
    from fasterllm.bench.embed import run_embed_bench

    rates = run_embed_bench(EngineArgs(dtype="float32", device="cpu"), num_sentences=6, min_words=3, max_words=20,
                            repeats=1, with_hf=True, hf_batch_size=4)
    assert set(rates) == {"fasterllm", "transformers, input order", "transformers, length-sorted"}
    assert all(rate > 0 for rate in rates.values())
    cosines = [float(value) for value in re.findall(r"min cosine ([0-9.]+)", capsys.readouterr().out)]
    assert len(cosines) == 2 and min(cosines) >= 0.9999


def test_texts_tokenized_together_equal_texts_tokenized_one_by_one(llm):
    engine = llm.engine
    texts = ["short", "a b c " * 40, " ", "Ünïcödé, punctuation! And digits 12345.", "word " * 300]
    prompts = texts + [[101, 2000, 102]]
    tokenizer = llm.get_tokenizer()
    texts_and_ids = prompts[:-2] + prompts[-1:]
    for keep in (None, -1, 50):
        limit = engine.max_model_len if keep == -1 else keep

        def expected(prompt):  # the public tokenizer, text by text; ids come back as given (kept from the end)
            if isinstance(prompt, list):
                return prompt[-limit:] if limit else prompt
            return tokenizer.encode(prompt) if limit is None else tokenizer.encode_last(prompt, limit)
        one_by_one = [expected(p) for p in texts_and_ids]
        together = engine.tokenize(texts_and_ids, truncate_prompt_tokens=keep)
        assert together == one_by_one
    assert len(engine.tokenize(prompts, truncate_prompt_tokens=-1)[4]) == engine.max_model_len
