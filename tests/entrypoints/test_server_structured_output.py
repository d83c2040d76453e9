"""Structured output through the server and the official openai client: response_format (JSON schema, JSON
object, a pydantic model through chat.completions.parse) and vLLM's extra fields, whole and streamed."""
from __future__ import annotations

import json
import re

from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0)


def test_a_json_schema_response_format_parses_whole_and_streamed(client):
    schema = {**City.model_json_schema(), "additionalProperties": False}  # else other keys may follow, as JSON
    # schema allows (the client's parse() sends this strict form itself)
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100, temperature=0,
                                           response_format=response_format)
    City.model_validate_json(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100, temperature=0, stream=True,
                                            response_format=response_format)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content


def test_parse_returns_the_pydantic_object(client):
    reply = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=100, temperature=0.7, seed=4,
                                          response_format=City)
    assert isinstance(reply.choices[0].message.parsed, City)


def test_json_object_and_vllm_fields_hold(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=120, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    choices = ["sunny", "rainy", "foggy"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        reply = client.completions.create(model=MODEL, prompt="Tomorrow's weather:", max_tokens=5, temperature=1.0,
                                          seed=1, n=3, extra_body=extra)
        assert all(c.text in choices for c in reply.choices), extra
    reply = client.completions.create(model=MODEL, prompt="A date:", max_tokens=20, temperature=1.0, seed=2,
                                      extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", reply.choices[0].text)
