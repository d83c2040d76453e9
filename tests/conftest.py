"""Session-wide test settings."""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter. triton reads this when it is first imported,
# and transformers or torch may import it before any kernel test does, so it is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_embedder():
    """LLM(task="embed") on the SmolLM2 GGUF (a decoder: last-token pooling), fp32 on the CPU, loaded once for
    the offline and the server tests."""
    from fasterllm import LLM
    from fasterllm.loader.model_source import default_model_path

    return LLM(str(default_model_path()), task="embed", dtype="float32", device="cpu")
