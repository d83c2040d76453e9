"""The /v1/embeddings request logic: direct calls, and the real `openai` client over HTTP on 127.0.0.1.

The HTTP side here is a few lines of the standard library that hand the parsed body to create_embedding,
so the client's own request building and response parsing (base64 decoding included) are exercised.
"""
from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from fasterllm import LLM
from fasterllm.entrypoints.openai.protocol import OpenAIError
from fasterllm.entrypoints.openai.serving_embedding import create_embedding

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def llm():
    return LLM(task="embed", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def base_url(llm):
    engine = llm.engine

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                status, answer = 200, create_embedding(engine, body) if self.path == "/v1/embeddings" else None
            except OpenAIError as exc:
                status, answer = exc.status, exc.body()
            payload = json.dumps(answer).encode()
            self.send_response(status if answer is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    thread.join()


def test_float_and_base64_carry_the_same_vectors(llm):
    texts = ["The cat sleeps.", "Stock markets fell sharply today."]
    expected = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    as_float = create_embedding(llm.engine, {"input": texts, "model": "x"})
    as_base64 = create_embedding(llm.engine, {"input": texts, "encoding_format": "base64"})
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
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "dimensions": 64}, "dimensions", "dimensions=64 is not available"),
    ({"input": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens", "greater than or equal to -1"),
    ({"input": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens",
     "truncate_prompt_tokens=1000 must be -1 (the model's limit) or in [1, max_model_len=256]"),
    ({"input": "x", "temperature": 1}, "temperature", "Extra inputs are not permitted"),
])
def test_bad_requests_name_the_field(llm, body, param, message):
    with pytest.raises(OpenAIError) as info:
        create_embedding(llm.engine, body)
    assert info.value.status == 400 and info.value.param == param and message in info.value.message


def test_openai_client_round_trip(llm, base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
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
    long = client.embeddings.create(model="m", input="word " * 400, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": -1})
    assert long.usage.prompt_tokens == 256
    with pytest.raises(openai.BadRequestError, match="input 0: the text is empty"):
        client.embeddings.create(model="m", input="")
