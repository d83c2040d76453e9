"""Session-wide test settings."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter. triton reads this when it is first imported,
# and transformers or torch may import it before any kernel test does, so it is set before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_embedder(gguf):
    """LLM(task="embed") on the SmolLM2 GGUF (a decoder: last-token pooling), fp32 on the CPU, loaded once for
    the offline and the server tests."""
    from fasterllm import LLM

    return LLM(str(gguf), task="embed", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def gguf() -> Path:
    """The SmolLM2 GGUF: FASTERLLM_TEST_GGUF names it where the default model's package is not installed (a GPU
    machine), else the installed one."""
    from fasterllm.loader.model_source import default_model_path  # after TRITON_INTERPRET is set above

    return Path(os.environ["FASTERLLM_TEST_GGUF"]) if "FASTERLLM_TEST_GGUF" in os.environ else default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(gguf):
    """transformers on the same GGUF, fp32, loaded once for the parity and the embedding tests."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def tiny_seq2seq(tmp_path_factory):
    """family -> (checkpoint directory, transformers model) for every tiny encoder-decoder of seq2seq_models."""
    pytest.importorskip("transformers")
    from seq2seq_models import FAMILIES, build_tiny_seq2seq

    root = tmp_path_factory.mktemp("tiny_seq2seq")
    return {family: (root / family, build_tiny_seq2seq(family, root / family, seed=seed))
            for seed, family in enumerate(FAMILIES)}


@pytest.fixture
def cpu_kernels_on(monkeypatch):
    """Our C++ CPU kernels for this test: FASTERLLM_CPU_KERNELS=auto, unless the run names an ISA already (a run with
    the AVX2 code forced); skipped where they cannot build or run."""
    from fasterllm.kernels.native import cpu_extension

    _turn_cpu_kernels_on(monkeypatch)
    yield
    monkeypatch.undo()
    cpu_extension.kernel_isa.cache_clear()


@pytest.fixture(scope="module")
def module_cpu_kernels_on():
    """cpu_kernels_on for every test of a module (one model loaded for them all)."""
    from fasterllm.kernels.native import cpu_extension

    with pytest.MonkeyPatch.context() as patch:
        _turn_cpu_kernels_on(patch)
        yield
    cpu_extension.kernel_isa.cache_clear()


def _turn_cpu_kernels_on(patch: pytest.MonkeyPatch) -> None:
    from fasterllm.kernels.native import cpu_extension

    if os.environ.get(cpu_extension.ISA_ENV) not in cpu_extension.ISA_FLAGS:
        patch.setenv(cpu_extension.ISA_ENV, "auto")
    cpu_extension.kernel_isa.cache_clear()
    if not cpu_extension.available():
        pytest.skip("no C++ CPU extension here (no compiler, or no AVX2)")
