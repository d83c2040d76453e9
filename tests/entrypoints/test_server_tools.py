"""Tool calling through the real `openai` client: a named function or "required" always returns arguments that
validate against the function's schema (whole and streamed, finish_reason "tool_calls"); "auto" reads the Hermes
and Llama 3 formats back (checked on fixed model outputs, malformed ones becoming plain content); tool results go back
through the chat template; bad tool requests are 400s naming the field."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from fasterllm.entrypoints.openai.tool_calls import hermes_tool_calls, llama3_tool_calls, parse_tool_calls

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


def test_a_named_function_returns_arguments_that_validate(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_required_calls_one_of_the_tools_and_streams_the_call(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=80, temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            max_tokens=80, temperature=0, stream=True)
    chunks = list(stream)
    deltas = [tc for chunk in chunks for choice in chunk.choices for tc in choice.delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_go_back_through_the_template(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "tool_choice='required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "names the function 'nope', which is not among the tools ['get_weather']"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "constrains it again"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, body, message):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] in ("tool_choice", "tools")


def test_the_openai_client_raises_on_an_unknown_function(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})


NAMES = ["get_weather", "get_time"]


def test_hermes_format_is_parsed_and_anything_malformed_stays_content():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_tool_calls(text, "auto", NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    for malformed in ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # cut-off JSON
                      '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not a tool of the request
                      '<tool_call>{"name": "get_time", "arguments": "zone"}</tool_call>',  # arguments not an object
                      "The weather in Paris is sunny."):
        assert hermes_tool_calls(malformed, NAMES) == []
        assert parse_tool_calls(malformed, "auto", NAMES) == (malformed, [])


def test_llama3_json_format_is_parsed():
    _, calls = parse_tool_calls('{"name": "get_time", "parameters": {"zone": "UTC"}}', "auto", NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    listed = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": "{}"}]'
    assert [c.name for c in llama3_tool_calls(listed, NAMES)] == ["get_time", "get_weather"]
    assert llama3_tool_calls('{"name": "get_time"', NAMES) == []
