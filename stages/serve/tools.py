"""Tool calls: the text format a model writes them in, the grammar that forces it, and the parser
that turns it back into OpenAI `tool_calls`, whole or streamed.

The format is Hermes' (NousResearch Hermes 2 Pro, Qwen 2.5 and 3; vLLM's `hermes` tool parser), one
block per call, blocks separated by a newline:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The chat template renders an assistant turn's `tool_calls` in exactly this text (`render_tool_call`),
so a model post-trained on our template sees in its history what it is asked to write.

- tool_choice "auto": the output is free; calls written in this format are parsed out of it.
- "required" / a named function: the output is constrained (structured_output.py) to one or more
  blocks (one, of that function), each call's arguments to its tool's `parameters` JSON schema, so
  what comes back always parses.
- "none": no parsing; the text is the content.

`arguments` is returned as the exact JSON text the model wrote, whole or as the concatenation of
the streamed pieces (the two are equal by construction: both come out of one parser).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import regex

from .structured_output import MAX_WHITESPACE_RUN, bounded_strings_as_patterns

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
CALL_PREFIX = TOOL_CALL_BEGIN + '\n{"name": '
ARGUMENTS_KEY = ', "arguments": '
CALL_SUFFIX = "}\n" + TOOL_CALL_END
SEPARATOR = "\n"


def render_tool_call(name: str, arguments: str | dict) -> str:
    """One call as the model writes it (the chat template renders history the same way)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"{CALL_PREFIX}{json.dumps(name, ensure_ascii=False)}{ARGUMENTS_KEY}{args}{CALL_SUFFIX}"


def tool_call_structural_tag(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool = True) -> dict | None:
    """The xgrammar structural tag (JSON) that forces calls: at least one block of any tool under
    "required" (at most one when parallel calls are off), exactly one of the named function
    otherwise; None for "auto" and "none", which leave the output free. `tools` are OpenAI tool
    objects ({"type": "function", "function": {"name", "parameters"}})."""
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat

    if tool_choice in ("auto", "none", None):
        return None

    def tag(fn: dict) -> TagFormat:
        schema = fn.get("parameters")
        if schema is None or fn.get("strict") is False:
            schema = {"type": "object"}  # arguments free, but still a JSON object
        begin = CALL_PREFIX + json.dumps(fn["name"], ensure_ascii=False) + ARGUMENTS_KEY
        return TagFormat(begin=begin, content=JSONSchemaFormat(json_schema=bounded_strings_as_patterns(schema),
                                                               max_whitespace_cnt=MAX_WHITESPACE_RUN),
                         end=CALL_SUFFIX)

    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        fmt: Any = tag(next(f for f in functions if f["name"] == name))
    elif tool_choice == "required":
        fmt = TagsWithSeparatorFormat(tags=[tag(f) for f in functions], separator=SEPARATOR, at_least_one=True,
                                      stop_after_first=not parallel_tool_calls)
    else:
        raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {tool_choice!r}")
    return StructuralTag(format=fmt).model_dump(mode="json")


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's id format


@dataclass
class ToolCallDelta:
    """A piece of one call, as a `delta.tool_calls` entry: the first piece carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn = {"name": self.name, **fn}
        out: dict = {"index": self.index, "function": fn}
        if self.id is not None:
            out = {"index": self.index, "id": self.id, "type": "function", "function": fn}
        return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# the head of a call in our format, up to where its arguments' value starts; `regex` (not `re`) for
# partial matching: is this text still the beginning of such a head?
_HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCallParser:
    """Splits generated text into content and tool calls, incrementally: `feed` each new piece of
    text, then `finish`. A call's name goes out as soon as its head is complete, its arguments as
    they arrive (up to the end of the arguments' JSON value); text that could still become
    `<tool_call>` is held back from the content, and whitespace between calls is dropped. A block
    whose head has another shape (arguments before name, say) is parsed whole at its end; one that
    is not a call at all is given back as content."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""  # text not yet handed out
    _state: str = "text"  # text | after_call | head | arguments | closing | block
    _args: str = ""  # the current call's arguments text so far
    _decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New content and call pieces after `text` (the newly generated text)."""
        self._buf += text
        content, deltas = "", []
        while True:
            progressed, c, d = self._step()
            content += c
            deltas.extend(d)
            if not progressed:
                break
        self.content += content
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of generation: whatever was held back. A call cut off mid-way keeps the
        arguments written so far (the finish reason says the output was cut)."""
        content, deltas = "", []
        state, buf = self._state, self._buf
        if state == "text":
            content = buf
        elif state in ("head", "block"):
            content = TOOL_CALL_BEGIN + buf  # never became a call: it was text after all
        elif state == "arguments" and buf:
            deltas.append(self._arguments(buf))
        self._buf, self._state = "", "text"
        self.content += content
        return content, deltas

    def _arguments(self, piece: str) -> ToolCallDelta:
        self._args += piece
        self.calls[-1].arguments += piece
        return ToolCallDelta(index=len(self.calls) - 1, arguments=piece)

    def _new_call(self, name: str, arguments: str = "") -> ToolCallDelta:
        call = ToolCall(new_tool_call_id(), name, arguments)
        self.calls.append(call)
        return ToolCallDelta(index=len(self.calls) - 1, id=call.id, name=name, arguments=arguments)

    def _step(self) -> tuple[bool, str, list[ToolCallDelta]]:
        buf, state = self._buf, self._state
        if state == "after_call":
            rest = buf.lstrip()
            self._buf = rest
            if not rest:
                return False, "", []
            self._state = "text"
            return True, "", []
        if state == "text":
            at = buf.find(TOOL_CALL_BEGIN)
            if at >= 0:
                self._buf, self._state = buf[at + len(TOOL_CALL_BEGIN):], "head"
                return True, buf[:at], []
            keep = next((n for n in range(min(len(buf), len(TOOL_CALL_BEGIN) - 1), 0, -1)
                         if TOOL_CALL_BEGIN.startswith(buf[-n:])), 0)
            self._buf = buf[len(buf) - keep:]
            return False, buf[:len(buf) - keep], []
        if state == "head":
            m = _HEADER.match(buf)
            if m is not None and m.end() < len(buf):  # a whole head, and its arguments have begun
                self._buf, self._state, self._args = buf[m.end():], "arguments", ""
                return True, "", [self._new_call(json.loads(m.group(1)))]
            if _HEADER.fullmatch(buf, partial=True) is None:  # another shape: parse the block whole
                self._state = "block" if buf.lstrip().startswith("{") or not buf.strip() else "text"
                if self._state == "text":
                    self._buf = ""
                    return True, TOOL_CALL_BEGIN + buf, []
                return True, "", []
            return False, "", []
        if state == "arguments":
            whole = self._args + buf
            try:
                _, end = self._decoder.raw_decode(whole)
            except json.JSONDecodeError:
                if not buf:
                    return False, "", []
                self._buf = ""  # the value is still open: everything so far belongs to it
                return False, "", [self._arguments(buf)]
            rest = end - len(self._args)
            self._buf, self._state = buf[rest:], "closing"
            return True, "", [self._arguments(buf[:rest])] if rest > 0 else []
        at = buf.find(TOOL_CALL_END)  # closing or block: wait for </tool_call>
        if at < 0:
            return False, "", []
        block, self._buf, self._state = buf[:at], buf[at + len(TOOL_CALL_END):], "after_call"
        if state == "closing":
            return True, "", []
        try:
            obj = json.loads(block)
            name, args = obj["name"], obj["arguments"]
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            self._state = "text"
            return True, TOOL_CALL_BEGIN + block + TOOL_CALL_END, []
        return True, "", [self._new_call(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))]


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Content and calls of a whole generated text (the parser fed in one piece)."""
    p = ToolCallParser()
    p.feed(text)
    p.finish()
    return p.content, p.calls
