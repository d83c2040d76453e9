"""Fixtures for the parity tests: each model (ours and transformers') is loaded once per session.
"""
from __future__ import annotations


import pytest
import torch

from parity_utils import TINY_SPECS, build_tiny_model

from fasterllm.loader.model_source import DEFAULT_MODEL_FILE as SMOLLM2_FILE
from fasterllm.loader.model_source import default_model_path


@pytest.fixture(scope="session")
def smollm2_path():
    return default_model_path().parent  # raises, naming the fix, when the default model is missing


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """Our engine on the SmolLM2 GGUF, roomy settings: whole prompts fit one step."""
    from fasterllm import LLM

    return LLM(None, dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, gguf_file=SMOLLM2_FILE,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_path, gguf_file=SMOLLM2_FILE)


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
