"""Tool calling for /v1/chat/completions: what `tool_choice` asks of the output, and the tool calls in a finished
text.

A named function or "required" constrains the output with a JSON schema (structured output), so its arguments always
parse: a named call's output is the arguments object itself; "required" writes {"name": ..., "arguments": {...}} for
one of the tools. "auto" lets the model write as it was trained to, and parsers read its tool calls back: the Hermes
format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, SmolLM2's and Qwen's) and Llama 3's (the whole
answer one JSON object, or a list of them, with "name" and "parameters"). A text that does not parse as calls of the
request's tools is plain content, never an error.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fasterllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def tool_mode(request: ChatCompletionRequest) -> str | None:
    """The request's tool mode: "auto", "required", a function's name, or None (no tool calls: no tools, or
    tool_choice "none"); a choice that names no tool of the request is a 400 naming tool_choice."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise OpenAIError(400, f"tool_choice={_shown(choice)} needs tools; send the functions in tools",
                              "tool_choice")
        return None
    if choice is None or choice == "auto":
        return "auto"
    if choice in ("none", "required"):
        return None if choice == "none" else choice
    names = [tool.function.name for tool in request.tools]
    if choice.function.name not in names:
        raise OpenAIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                               f"tools {names}", "tool_choice")
    return choice.function.name


def tool_schema(request: ChatCompletionRequest, mode: str | None) -> dict[str, Any] | None:
    """The JSON schema the output must follow for a named function or "required"; None for "auto" and no tools."""
    if mode in (None, "auto"):
        return None
    parameters = {tool.function.name: tool.function.parameters or _ANY_OBJECT for tool in request.tools}
    if mode != "required":
        return parameters[mode]
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, schema in parameters.items()]}


def parse_tool_calls(text: str, mode: str, tool_names: list[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished text under a tool mode."""
    if mode == "required":
        call = json.loads(text)  # the schema made it parse
        return None, [ToolCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False))]
    if mode != "auto":
        return None, [ToolCall(mode, text.strip())]
    calls = hermes_tool_calls(text, tool_names)
    if calls:
        content = _HERMES.sub("", text).strip()
        return content or None, calls
    calls = llama3_tool_calls(text, tool_names)
    return (None, calls) if calls else (text, [])


def hermes_tool_calls(text: str, tool_names: list[str]) -> list[ToolCall]:
    """Every <tool_call> block's call, or none if any block is not a call of one of the tools."""
    blocks = _HERMES.findall(text)
    calls = [_call(block, tool_names) for block in blocks]
    return calls if blocks and all(calls) else []


def llama3_tool_calls(text: str, tool_names: list[str]) -> list[ToolCall]:
    """The whole text as one call object or a list of them ("parameters" or "arguments"), or none."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return []
    objects = value if isinstance(value, list) else [value]
    calls = [_call_from(obj, tool_names) for obj in objects]
    return calls if objects and all(calls) else []


def _call(block: str, tool_names: list[str]) -> ToolCall | None:
    try:
        return _call_from(json.loads(block), tool_names)
    except ValueError:
        return None


def _call_from(obj: Any, tool_names: list[str]) -> ToolCall | None:
    """A call object of either format: Hermes writes its arguments under "arguments", Llama 3 under "parameters"."""
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _shown(choice: Any) -> str:
    return repr(choice if isinstance(choice, str) else choice.model_dump())
