"""/v1/embeddings served from a decoder (the SmolLM2 GGUF, last-token pooling), as `fasterllm serve
--embedding-model <gguf path>` builds it, through the real `openai` client on 127.0.0.1."""
from __future__ import annotations

import openai
import pytest
import torch
from server_utils import ServerThread, dummy_generator


@pytest.fixture(scope="module")
def served(smollm2_embedder):
    handle = ServerThread(dummy_generator(), served_model_name="smol", embedding_engine=smollm2_embedder.engine)
    yield handle
    handle.stop()


def test_served_vectors_equal_the_offline_api(served, smollm2_embedder):
    client, name = served.client(), smollm2_embedder.engine.model_name
    assert [m.id for m in client.models.list().data] == ["smol", name]
    texts = ["The cat sleeps on the mat.", "Hi", "Stock markets fell sharply today after the announcement."]
    expected = torch.tensor([o.outputs.embedding for o in smollm2_embedder.embed(texts, use_tqdm=False)])
    # the client's default asks for base64 and decodes it; float comes as JSON numbers
    for format_kwargs in ({}, {"encoding_format": "float"}):
        response = client.embeddings.create(model=name, input=texts, **format_kwargs)
        torch.testing.assert_close(torch.tensor([d.embedding for d in response.data]), expected)
    ids = smollm2_embedder.get_tokenizer().encode(texts[0])
    by_ids = client.embeddings.create(model=name, input=ids)
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), expected[0])
    assert by_ids.usage.prompt_tokens == len(ids)


def test_bad_requests_name_the_input(served, smollm2_embedder):
    client, name = served.client(), smollm2_embedder.engine.model_name
    with pytest.raises(openai.BadRequestError, match="input 1: the text is empty"):
        client.embeddings.create(model=name, input=["ok", ""])
    with pytest.raises(openai.BadRequestError, match="dimensions=64 is not available.*576-dimensional"):
        client.embeddings.create(model=name, input="ok", dimensions=64)
    assert len(client.embeddings.create(model=name, input="still serving").data[0].embedding) == 576
