"""CUDA graphs of the encoder (GPU only): replays agree with eager runs and with transformers, and batches of
several sizes each replay their own bucket's graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
transformers = pytest.importorskip("transformers")

from fasterllm import LLM  # noqa: E402
from fasterllm.bench.embed import _hf_pool, mixed_sentences, word_vocabulary  # noqa: E402
from fasterllm.bench.random_encoder import make_random_encoder  # noqa: E402


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return make_random_encoder(tmp_path_factory.mktemp("minilm"), "minilm-l6")


def _vectors(llm: LLM, sentences: list[str]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)])


def _transformers_vectors(path, llm: LLM, sentences: list[str], dtype: torch.dtype) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").cuda().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    inputs = tokenizer(sentences, padding=True, return_tensors="pt").to("cuda")
    with torch.inference_mode():
        hidden = model(**inputs).last_hidden_state
    return _hf_pool(hidden, inputs["attention_mask"], llm.engine.pooling).cpu()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replays_match_eager_and_transformers(encoder_dir, dtype):
    graphed = LLM(model=str(encoder_dir), task="embed", dtype=dtype, device="cuda")
    eager = LLM(model=str(encoder_dir), task="embed", dtype=dtype, device="cuda", enforce_eager=True)
    sentences = mixed_sentences(word_vocabulary(graphed), 100, 1, 120, seed=3)  # ~6,400 tokens: one graph batch
    for batch in (sentences[:1], sentences[:7], sentences[:40], sentences):  # a different bucket each
        got, expected = _vectors(graphed, batch), _vectors(eager, batch)
        # padded GEMMs may take other cuBLAS kernels: bf16 roundings differ, fp32 ones barely
        assert F.cosine_similarity(got, expected).min() >= (0.999999 if dtype == "float32" else 0.9999)
    assert len(graphed.engine.runner.graphs.captured) >= 4 and eager.engine.runner.graphs is None
    reference = _transformers_vectors(encoder_dir, graphed, sentences[:40], graphed.engine.dtype)
    assert F.cosine_similarity(_vectors(graphed, sentences[:40]), reference).min() >= 0.9999


def test_a_batch_past_the_largest_bucket_runs_eagerly(encoder_dir):
    llm = LLM(model=str(encoder_dir), task="embed", dtype="bfloat16", device="cuda")
    long_sentences = mixed_sentences(word_vocabulary(llm), 120, 100, 120, seed=4)  # > 8,192 tokens in one batch
    vectors = _vectors(llm, long_sentences)
    assert not llm.engine.runner.graphs.captured
    eager = LLM(model=str(encoder_dir), task="embed", dtype="bfloat16", device="cuda", enforce_eager=True)
    assert F.cosine_similarity(vectors, _vectors(eager, long_sentences)).min() >= 0.99999
