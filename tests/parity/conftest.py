"""Fixtures for the parity tests: each model (ours and transformers') is loaded once per session.
"""
from __future__ import annotations

import pytest

from parity_utils import NEW_TOKENS, SMOLLM2_TEXTS, TINY_SPECS, build_tiny_model, hf_greedy


@pytest.fixture(scope="session")
def smollm2_llm(gguf):
    """Our engine on the SmolLM2 GGUF, roomy settings: whole prompts fit one step."""
    from fasterllm import LLM

    return LLM(str(gguf), dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """name -> (checkpoint directory, transformers model) for every TINY_SPECS entry."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny_models")
    built = {}
    for seed, spec in enumerate(TINY_SPECS):
        directory = root / spec.name
        built[spec.name] = (directory, build_tiny_model(spec, directory, seed=seed))
    return built


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in SMOLLM2_TEXTS]
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 3 and 50 <= max(lengths) <= 70, lengths
    return prompts


@pytest.fixture(scope="session")
def smollm2_reference(hf_smollm2, smollm2_prompts):
    """transformers' greedy continuation of each prompt, run alone."""
    refs = [hf_greedy(hf_smollm2, ids, NEW_TOKENS) for ids in smollm2_prompts]
    for text, ref in zip(SMOLLM2_TEXTS, refs):
        assert len(ref) == NEW_TOKENS, f"transformers hit EOS early on {text!r}; pick a prompt that runs on"
    return refs
