"""POST /v1/embeddings on the real server (FastAPI validating protocol.EmbeddingRequest) with the embedded
all-MiniLM-L6-v2: raw bodies over HTTP for the response and error shapes, and the real `openai` client for its
own request building and response parsing (base64 decoding included)."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from server_utils import ServerThread, dummy_generator

from fasterllm import LLM

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def llm():
    return LLM(task="embed", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def served(llm):
    handle = ServerThread(dummy_generator(), served_model_name="smol", embedding_engine=llm.engine)
    yield handle
    handle.stop()


def _post(served: ServerThread, body: dict) -> httpx.Response:
    return httpx.post(served.url + "/v1/embeddings", json=body, timeout=60)


def test_float_and_base64_carry_the_same_vectors(llm, served):
    texts = ["The cat sleeps.", "Stock markets fell sharply today."]
    expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    as_float = _post(served, {"input": texts, "model": "all-MiniLM-L6-v2"}).json()
    as_base64 = _post(served, {"input": texts, "encoding_format": "base64"}).json()
    assert as_float["object"] == "list" and as_float["model"] == "all-MiniLM-L6-v2"
    assert [d["index"] for d in as_float["data"]] == [0, 1]
    assert [d["embedding"] for d in as_float["data"]] == expected
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() for d in as_base64["data"]]
    assert decoded == expected  # the same float32 values, bit for bit
    prompt_tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    assert as_float["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "input is an empty list"),
    ({"input": ""}, "input", "input 0: the text is empty"),
    ({"input": ["ok", "word " * 400]}, "input", "input 1: the input has 402 tokens but max_model_len is 256"),
    ({"input": 5}, "input", "input: 5 is none of the accepted types (str | list[str] | list[int] | list[list[int]])"),
    ({"model": "all-MiniLM-L6-v2"}, "input", "input: Field required"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "dimensions": 64}, "dimensions", "dimensions=64 is not available"),
    ({"input": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens", "greater than or equal to -1"),
    ({"input": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens",
     "truncate_prompt_tokens=1000 must be -1 (the model's limit) or in [1, max_model_len=256]"),
    ({"input": "x", "temperature": 1}, "temperature", "Extra inputs are not permitted"),
])
def test_bad_requests_name_the_field(served, body, param, message):
    response = _post(served, body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["param"] == param and message in error["message"]


def test_the_body_is_validated_by_fastapi_against_the_declared_model(served):
    schema = httpx.get(served.url + "/openapi.json").json()
    body = schema["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/EmbeddingRequest"}
    assert set(schema["components"]["schemas"]["EmbeddingRequest"]["properties"]) == {
        "input", "model", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"}
    # bodies without the JSON content type: FastAPI leaves them unparsed; the error says which fix applies
    not_json = httpx.post(served.url + "/v1/embeddings", content=b"{not json")
    assert not_json.status_code == 400 and "The request body is not valid JSON" in not_json.json()["error"]["message"]
    no_header = httpx.post(served.url + "/v1/embeddings", content=b'{"input": "hi"}',
                           headers={"content-type": "application/x-www-form-urlencoded"})  # as `curl -d` sends it
    assert no_header.status_code == 400 and no_header.json()["error"]["message"] == (
        "The request body is JSON but came without the header 'Content-Type: application/json'; send that header "
        "with it")


def test_openai_client_round_trip(llm, served):
    client = served.client()
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    expected = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    # without encoding_format the client asks for base64 and decodes it itself
    for kwargs in ({}, {"encoding_format": "float"}):
        response = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, **kwargs)
        got = torch.tensor([d.embedding for d in response.data])
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        assert response.usage.prompt_tokens == sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    ids = llm.get_tokenizer().encode("A man is eating food.")
    by_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(expected[0].tolist(), abs=1e-6)
    long = client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 400, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": -1})
    assert long.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError, match="input 0: the text is empty"):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="")
    with pytest.raises(openai.NotFoundError, match="its embeddings model is 'all-MiniLM-L6-v2'"):
        client.embeddings.create(model="smol", input="hi")
