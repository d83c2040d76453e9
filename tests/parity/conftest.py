"""Fixtures for the parity tests: each model (ours and transformers') is loaded once per session.
"""
from __future__ import annotations

import pytest

from parity_utils import TINY_SPECS, build_tiny_model


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
