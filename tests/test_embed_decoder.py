"""Embeddings from a decoder: LLM(<SmolLM2 GGUF>, task="embed") against transformers on the same file, batching,
truncation and the errors a user meets."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fasterllm import LLM
from fasterllm.loader.model_source import default_model_path

CHAPTER = (Path(__file__).parent / "data" / "pride_and_prejudice_ch1.txt").read_text()
TEXTS = ["Hi", "The capital of France is Paris.", CHAPTER[:1500], "A man is eating a piece of bread.",
         CHAPTER[2000:2300]]


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def _hf_last_token(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1]  # after the final norm
    return F.normalize(hidden[0, -1], dim=-1)


def test_vectors_match_transformers_last_token_for_a_mixed_length_batch(smollm2_embedder, hf_smollm2):
    outputs = smollm2_embedder.embed(TEXTS, use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outputs]
    assert min(lengths) == 1 and max(lengths) > 300  # a one-token input beside a few-hundred-token one
    assert [o.prompt_token_ids for o in outputs] == [smollm2_embedder.get_tokenizer().encode(t) for t in TEXTS]
    vectors = _vectors(outputs)
    assert vectors.shape == (len(TEXTS), 576) and outputs[0].outputs.hidden_size == 576
    torch.testing.assert_close(vectors.norm(dim=1), torch.ones(len(TEXTS)))
    for output, vector in zip(outputs, vectors):
        reference = _hf_last_token(hf_smollm2, output.prompt_token_ids)
        assert F.cosine_similarity(vector, reference, dim=0) >= 0.9999, output.prompt


def test_token_budget_splits_batches_without_changing_vectors(smollm2_embedder, monkeypatch):
    engine = smollm2_embedder.engine
    whole = _vectors(smollm2_embedder.embed(TEXTS, use_tqdm=False))
    seen_batches = []
    embed_batch = engine.runner.embed
    monkeypatch.setattr(engine, "max_num_batched_tokens", 400)
    monkeypatch.setattr(engine.runner, "embed", lambda ids: seen_batches.append([len(s) for s in ids]) or
                        embed_batch(ids))
    split = _vectors(smollm2_embedder.embed(TEXTS, use_tqdm=False))
    assert len(seen_batches) > 1 and all(sum(batch) <= 400 for batch in seen_batches)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_truncation_keeps_the_last_tokens(smollm2_embedder):
    full_ids = smollm2_embedder.get_tokenizer().encode(CHAPTER[:1500])
    kept = smollm2_embedder.embed(CHAPTER[:1500], truncate_prompt_tokens=12, use_tqdm=False)[0]
    assert kept.prompt_token_ids == full_ids[-12:]
    from_ids = smollm2_embedder.embed({"prompt_token_ids": full_ids[-12:]}, use_tqdm=False)[0]
    torch.testing.assert_close(_vectors([kept]), _vectors([from_ids]))


def test_bad_inputs_get_clear_errors(smollm2_embedder):
    with pytest.raises(ValueError, match=r"input 1: the text is empty"):
        smollm2_embedder.embed(["fine", ""])
    with pytest.raises(ValueError, match=r"token ids \[49152\] are not valid: ids must be integers in \[0, 49152\)"):
        smollm2_embedder.embed({"prompt_token_ids": [1, 49152]})
    with pytest.raises(ValueError, match=r"input 0: the input has \d+ tokens but max_model_len is 8192.*"
                                         "truncate_prompt_tokens=-1"):
        smollm2_embedder.embed("word " * 9000)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=9000 must be -1 .* max_model_len=8192"):
        smollm2_embedder.embed("hello", truncate_prompt_tokens=9000)
    with pytest.raises(ValueError, match="task='embed'.*use embed"):
        smollm2_embedder.generate("Hello")


def test_checkpoints_that_cannot_serve_are_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="max_model_len=9000 exceeds the model's 8192 positions"):
        LLM(str(default_model_path()), task="embed", device="cpu", max_model_len=9000)
    config = {"architectures": ["FalconForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architecture 'FalconForCausalLM' is not supported; supported: .*"
                                         "LlamaForCausalLM"):
        LLM(str(tmp_path), task="embed", device="cpu")
    with pytest.raises(ValueError, match="quantization=.fp8. has no CPU kernels"):
        LLM(str(default_model_path()), task="embed", device="cpu", quantization="fp8")


def test_quantization_and_dummy_weights_reach_the_decoder(smollm2_embedder):
    texts = TEXTS[:2] + TEXTS[3:4]
    float_vectors = _vectors(smollm2_embedder.embed(texts, use_tqdm=False))
    int8 = LLM(str(default_model_path()), task="embed", dtype="float32", device="cpu", quantization="int8")
    int8_vectors = _vectors(int8.embed(texts, use_tqdm=False))
    # close to the float vectors, yet not them: the int8 weights ran
    assert (F.cosine_similarity(int8_vectors, float_vectors, dim=1) >= 0.99).all()
    assert (int8_vectors - float_vectors).abs().max() > 1e-3
    dummy = LLM(str(default_model_path()), task="embed", dtype="float32", device="cpu", load_format="dummy")
    assert (F.cosine_similarity(_vectors(dummy.embed(texts, use_tqdm=False)), float_vectors, dim=1) < 0.5).all()


@pytest.mark.parametrize("option, message", [
    ({"quantization": "int8"}, "quantization='int8' is not supported for all-MiniLM-L6-v2: BERT-family encoders run "
                               "unquantized; leave quantization out"),
    ({"load_format": "dummy"}, "load_format='dummy' is not supported for all-MiniLM-L6-v2: BERT-family encoders "
                               "always load their checkpoint's weights; leave load_format out"),
])
def test_encoders_refuse_weight_options_they_would_ignore(option, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(task="embed", device="cpu", **option)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, min_cosine", [("float32", 0.9999), ("bfloat16", 0.98)])
def test_gpu_vectors_match_the_cpu_fp32_ones(gguf, smollm2_embedder, dtype, min_cosine):
    gpu = LLM(str(gguf), task="embed", dtype=dtype, device="cuda")
    on_gpu = _vectors(gpu.embed(TEXTS, use_tqdm=False))
    on_cpu = _vectors(smollm2_embedder.embed(TEXTS, use_tqdm=False))
    assert (F.cosine_similarity(on_gpu, on_cpu, dim=1) >= min_cosine).all()
