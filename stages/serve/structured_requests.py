"""The request fields that constrain an output, as OpenAI and vLLM clients send them, and the tool
calls put back into chat responses.

Fields: OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}) and, on chat, `tools`, `tool_choice` and
`parallel_tool_calls`; vLLM's `structured_outputs` ({json, regex, choice, grammar, json_object,
structural_tag, disable_any_whitespace, ...}), its `response_format` {"type": "structural_tag"},
and the older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` that clients of
vLLM before 0.11 still send. They become one StructuredOutput for the engine
(structured_output.py); a request naming two constraints, a forced tool call beside a structured
output, a tool_choice without tools, a named tool that is not among the tools or a schema that is
not one gets a 400 naming it. Tool-call text is parsed by tools.py.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .structured_output import StructuredOutput, check_json_schema
from .tools import ToolCallDelta, ToolCallParser, tool_call_structural_tag


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    format: dict[str, Any] | None = None  # structural_tag (xgrammar's format object)


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` request field (its StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # one backend here: nothing to fall back to
    disable_additional_properties: bool = False  # xgrammar's JSON grammars never add undeclared properties
    whitespace_pattern: str | None = None


class StructuredOutputFields(BaseModel):
    """Mixed into the completion and chat request models."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and unused: xgrammar is the one backend
    guided_whitespace_pattern: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolFields(BaseModel):
    """Mixed into the chat request model."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


def _json_value(value: Any, field: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: not valid JSON ({e.msg} at position {e.pos})") from None
    return value


def _requested(body: StructuredOutputFields) -> list[tuple[str, dict]]:
    """Every constraint the request names: (field, StructuredOutput arguments)."""
    found: list[tuple[str, dict]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format: type 'json_schema' needs json_schema.schema")
            found.append(("response_format", {"json": rf.json_schema.json_schema}))
        else:
            if rf.format is None:
                raise ValueError("response_format: type 'structural_tag' needs a format")
            found.append(("response_format", {"structural_tag": {"type": "structural_tag", "format": rf.format}}))
    so = body.structured_outputs
    if so is not None:
        if so.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                             "use disable_any_whitespace")
        for key, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                           ("grammar", so.grammar), ("structural_tag", so.structural_tag)):
            if value is not None:
                if key in ("json", "structural_tag"):
                    value = _json_value(value, f"structured_outputs.{key}")
                found.append((f"structured_outputs.{key}", {key: value}))
        if so.json_object:
            found.append(("structured_outputs.json_object", {"json_object": True}))
    if body.guided_whitespace_pattern is not None:
        raise ValueError("guided_whitespace_pattern is not supported by the xgrammar backend")
    for key, value in (("json", body.guided_json), ("regex", body.guided_regex), ("choice", body.guided_choice),
                       ("grammar", body.guided_grammar)):
        if value is not None:
            if key == "json":
                value = _json_value(value, "guided_json")
            found.append((f"guided_{key}", {key: value}))
    return found


def _check_tools(body: ToolFields) -> tuple[str | dict, list[dict]]:
    """The effective tool_choice ("auto" when tools are given and no choice, else "none") and the
    tools as plain dicts; ValueError for the combinations vLLM refuses."""
    if body.tools is not None and not body.tools:
        raise ValueError("tools must not be an empty array; give at least one tool or omit the field")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise ValueError("tool_choice needs tools: give the tools it chooses from")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    for t in tools:
        params = t["function"].get("parameters")
        if params is not None:
            check_json_schema(params, f"tools[{t['function']['name']}].parameters")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the tools {names}")
        choice = choice.model_dump()
    return choice, tools


def structured_output_of(body: StructuredOutputFields) -> StructuredOutput | None:
    """The engine constraint a request asks for (None: free output). ValueError -> 400."""
    found = _requested(body)
    whitespace = not (body.structured_outputs is not None and body.structured_outputs.disable_any_whitespace)
    if isinstance(body, ToolFields):
        choice, tools = _check_tools(body)
        if choice == "required" or isinstance(choice, dict):
            if found:
                raise ValueError(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} forces a "
                                 f"tool call, which cannot be combined with {found[0][0]}: use one or the other")
            tag = tool_call_structural_tag(tools, choice, body.parallel_tool_calls is not False)
            return StructuredOutput(structural_tag=tag, origin="tools", any_whitespace=whitespace)
    if not found:
        return None
    if len(found) > 1:
        raise ValueError("give one output constraint, got " + ", ".join(f for f, _ in found))
    origin, kwargs = found[0]
    return StructuredOutput(**kwargs, any_whitespace=whitespace, origin=origin)


def tool_parser_for(body: Any) -> ToolCallParser | None:
    """A parser for the chat output when tool calls are to be parsed out of it (tools given and
    tool_choice not "none")."""
    if not isinstance(body, ToolFields) or not body.tools or body.tool_choice == "none":
        return None
    return ToolCallParser()


def chat_finish_reason(parser: ToolCallParser | None, finish_reason: str | None) -> str | None:
    """"tool_calls" for an output that ended on its own with calls in it."""
    if parser is not None and parser.calls and finish_reason == "stop":
        return "tool_calls"
    return finish_reason


def assistant_message(body: Any, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The chat `message` for a whole output and its finish_reason: content, and tool_calls when
    the model called tools."""
    parser = tool_parser_for(body)
    if parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parser.feed(text)
    parser.finish()
    message: dict = {"role": "assistant", "content": parser.content if parser.content.strip() or not parser.calls else None}
    if parser.calls:
        message["tool_calls"] = [c.to_openai() for c in parser.calls]
    return message, chat_finish_reason(parser, finish_reason)


def stream_delta(parser: ToolCallParser, text: str, finished: bool) -> tuple[str, list[dict]]:
    """The content and `delta.tool_calls` entries of one streamed chunk."""
    content, deltas = parser.feed(text)
    if finished:
        more, last = parser.finish()
        content += more
        deltas = _merge(deltas + last)
    return content, [d.to_openai() for d in _merge(deltas)]


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One entry per call within a chunk (pieces of the same call concatenated)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].arguments += d.arguments
        else:
            out.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))
    return out
