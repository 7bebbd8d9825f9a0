"""`--tool-call-parser qwen3_coder`: the tool calls of a chat reply, as vLLM's parser of that name
reads them, for the chat API (api_chat.ChatShape). Qwen3.5 (as Qwen3-Coder) writes each call as

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

The rules (a stream gives the same result as the whole reply, however it is cut):
- each call becomes OpenAI's {"id": "call_...", "type": "function", "function": {"name",
  "arguments": a JSON string}}; a NAME that no tool of the request has is kept as a call;
- a VALUE loses one newline at each end; it stays a string unless the tool's JSON schema types
  the parameter as something else (number, integer, boolean, object, array, null), when it is
  read as JSON (a boolean's `True` too), falling back to the string when it is not JSON
  (NaN, Infinity and 1e999 are not: the arguments stay strict JSON; nor is a value nesting
  deeper than MAX_DEPTH, which json's reader and writer, both recursive, may refuse with a
  RecursionError); a parameter the schema
  does not know, or types as a string, is a string;
- closing tags may be missing, as vLLM allows: `</parameter>` before the next parameter or
  `</function>`, `</function>` and `</tool_call>` before the next `<tool_call>` or the reply's
  end (a reply cut at max_tokens inside a value keeps the value so far, less the start of a
  closing tag it was cut in); a `<tool_call>` inside a value (after a `<parameter=` not yet
  closed by `</parameter>` or `</function>`) is the value's text, not the next call, as in
  vLLM's parser (a `</tool_call>` there still ends the call, as in vLLM's);
- a `<tool_call>` not followed (after white space) by `<function=NAME>` (a name on one line),
  or cut before its name ends, is not a call: its text stays content, and so does text after
  `</function>` inside a call. Nothing of the reply is lost, nothing raises;
- the content is the text outside calls: white space just before a call or after the last one
  is dropped (a reply of calls alone has no content), text between or after calls is kept.
"""

from __future__ import annotations

import json
import math
import uuid

from statechat.api_reasoning import tag_start

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
MAX_NAME = 256  # characters a function's name may have (past it, the tag is not a call)
# how deep a typed value may nest (deeper, it stays the string: a reply of a thousand "[" made
# json.loads, or the arguments' json.dumps, raise RecursionError, ending a batch or a response)
MAX_DEPTH = 100


def new_call_id() -> str:
    """An id for a parsed call (OpenAI's shape: `call_` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """The calls of one reply whose text comes in pieces: `feed` each piece, then `flush` once it
    has ended. Each returns (content, deltas): the content text that may go out now, and
    OpenAI's tool-call deltas (a call's {"index", "id", "type", "function": {"name",
    "arguments": ""}} once its name is read, then {"index", "function": {"arguments"}} with the
    arguments whole once the call has ended). `calls` holds the calls ended so far, as a
    message's `tool_calls` holds them."""

    def __init__(self, tools: list[dict] | None) -> None:
        """`tools`: the request's (OpenAI function tools, checked), whose schemas type values."""
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                        for t in tools or ()}
        self.state = "content"  # or "head" (after <tool_call>), "body" (after <function=NAME>)
        self.held = ""  # text not given out yet
        self.dropped = ""  # the white space before the <tool_call> being read
        self.calls: list[dict] = []
        self._call: dict = {}  # the call being read (its id and name)
        self._seen = 0  # how much of the call's body was searched for its end

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        content: list[str] = []
        deltas: list[dict] = []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def flush(self) -> tuple[str, list[dict]]:
        """What was held back, once the reply has ended: a call being read is ended (one cut
        before its name ended is content); trailing white space is dropped if there were calls."""
        content: list[str] = []
        deltas: list[dict] = []
        if self.state == "body":
            self._end_call(self.held, content, deltas)
            self.held = ""
        elif self.state == "head":
            self._not_a_call(content)
        content.append(self.held.rstrip() if self.calls else self.held)
        self.held = ""
        return "".join(content), deltas

    def _step(self, content: list[str], deltas: list[dict]) -> bool:
        """Give out what the held text decides; whether to look at it again."""
        if self.state == "content":
            return self._content(content)
        if self.state == "head":
            return self._head(content, deltas)
        start = max(0, self._seen - len(CALL_CLOSE))  # (a long value is not searched again)
        ends = [i for i in (self.held.find(CALL_CLOSE, start), self._next_call(start)) if i >= 0]
        if not ends:
            self._seen = len(self.held)
            return False
        end = min(ends)
        body, rest = self.held[:end], self.held[end:]
        self.held = rest.removeprefix(CALL_CLOSE)
        self._end_call(body, content, deltas)
        return True

    def _next_call(self, start: int) -> int:
        """Where the first `<tool_call>` from `start` of the call's held body is that begins
        another call (-1 if none): one inside a parameter's value is the value's text."""
        i = self.held.find(CALL_OPEN, start)
        while i >= 0 and in_value(self.held[:i]):
            i = self.held.find(CALL_OPEN, i + len(CALL_OPEN))
        return i

    def _content(self, content: list[str]) -> bool:
        """Content up to a `<tool_call>` (then read its head), else up to the white space or
        the tag's possible start that ends the held text (both wait for what follows)."""
        i = self.held.find(CALL_OPEN)
        text = self.held[:i] if i >= 0 else self.held[:len(self.held)
                                                      - tag_start(self.held, CALL_OPEN)]
        out = text.rstrip()
        content.append(out)
        if i < 0:
            self.held = self.held[len(out):]
            return False
        self.dropped, self.held = text[len(out):], self.held[i + len(CALL_OPEN):]
        self.state = "head"
        return True

    def _head(self, content: list[str], deltas: list[dict]) -> bool:
        """After `<tool_call>`: `<function=NAME>` makes it a call, anything else text."""
        head = self.held.lstrip()
        if not head.startswith(FUNC_OPEN):
            if FUNC_OPEN.startswith(head):
                return False  # (white space, or the tag's start: wait)
            return self._not_a_call(content)
        end = head.find(">")
        name = head[len(FUNC_OPEN):end if end >= 0 else len(head)]
        if "\n" in name or "<" in name or len(name) > MAX_NAME or (end >= 0 and not name.strip()):
            return self._not_a_call(content)
        if end < 0:
            return False
        self.held, self.state, self._seen = head[end + 1:], "body", 0
        self._call = {"id": new_call_id(), "type": "function",
                      "function": {"name": name.strip(), "arguments": ""}}
        deltas.append({"index": len(self.calls), **self._call,
                       "function": dict(self._call["function"])})
        return True

    def _not_a_call(self, content: list[str]) -> bool:
        """The `<tool_call>` being read is text: it goes out as content (with the white space
        before it), and what follows it is read again as content."""
        content.append(self.dropped + CALL_OPEN)
        self.dropped, self.state = "", "content"
        return True

    def _end_call(self, body: str, content: list[str], deltas: list[dict]) -> None:
        """End the call being read, `body` its text after `<function=NAME>`: its arguments'
        delta, and (as content) any text after its `</function>`."""
        params, _, after = body.partition(FUNC_CLOSE)
        after = after[:len(after) - tag_start(after, CALL_CLOSE)]  # (a reply cut in the tag)
        name = self._call["function"]["name"]
        arguments = json.dumps(read_parameters(params, self.schemas.get(name)),
                               ensure_ascii=False)
        deltas.append({"index": len(self.calls), "function": {"arguments": arguments}})
        self.calls.append({**self._call, "function": {"name": name, "arguments": arguments}})
        self.state = "content"
        if after.strip():
            content.append(after.rstrip())


def in_value(body: str) -> bool:
    """Whether a call's `body` (its text after `<function=NAME>`) ends inside a parameter's
    value: after its last `<parameter=`, with no `</parameter>` or `</function>` after that."""
    i = body.rfind(PARAM_OPEN)
    return i >= 0 and PARAM_CLOSE not in body[i:] and FUNC_CLOSE not in body[i:]


def read_parameters(text: str, schema: dict | None) -> dict:
    """The arguments of a call from its `<parameter=P>VALUE</parameter>` parts (a part with no
    `>` after its name is skipped; a later part of the same name wins), each value typed by
    `schema` (the tool's JSON schema of its parameters; None: an unknown tool)."""
    properties = (schema or {}).get("properties")
    properties = properties if isinstance(properties, dict) else {}
    arguments = {}
    for part in text.split(PARAM_OPEN)[1:]:
        name, is_named, value = part.partition(">")
        if not is_named or "\n" in name or not name.strip():
            continue
        value, is_closed, _ = value.partition(PARAM_CLOSE)
        if not is_closed:  # (a reply cut inside the closing tag: not the value's)
            value = value[:len(value) - max(tag_start(value, PARAM_CLOSE),
                                            tag_start(value, FUNC_CLOSE))]
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[name.strip()] = typed_value(value, properties.get(name.strip()))
    return arguments


def typed_value(value: str, schema) -> object:
    """`value` as its parameter's schema types it: a string unless the schema gives a type and
    none of its types is string, then JSON (a boolean's True and False too), else the string.
    Python's NaN, Infinity and numbers past a float's range are not JSON (a client's strict
    parser refuses the arguments): a value holding one stays the string, as does one nesting
    deeper than MAX_DEPTH."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return value
    try:
        typed = json.loads(value, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:  # (nested past the reader's stack: past MAX_DEPTH too)
        return value
    except ValueError:
        if "boolean" in kinds and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value
    return typed if _depth(typed) <= MAX_DEPTH else value


def _depth(value) -> int:
    """How deep a JSON value nests (a list or object: one more than its deepest item; 0 for a
    scalar), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((x, depth + 1) for x in (item.values() if isinstance(item, dict)
                                                  else item))
    return deepest


def _not_json(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    """A JSON number's float, ValueError for one past a float's range (1e999)."""
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text} is past a float's range")
    return number


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas as one stream delta's `tool_calls` holds them: one entry per call
    (a call whose name and arguments come in the same piece of text has both)."""
    merged: dict[int, dict] = {}
    for delta in deltas:
        entry = merged.setdefault(delta["index"], {"index": delta["index"]})
        function = {**entry.get("function", {}), **delta["function"]}
        entry.update(delta)
        entry["function"] = function
    return list(merged.values())


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole reply: what its stream gives; content None when empty."""
    stream = ToolCallStream(tools)
    content, _ = stream.feed(text)
    rest, _ = stream.flush()
    return (content + rest) or None, stream.calls
