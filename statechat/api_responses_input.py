"""The Responses API's `input` read as chat messages (api_responses.py): a string, or
message, function_call, function_call_output and reasoning items, each checked, its errors
naming the item (`input[2].content[0]`)."""

from __future__ import annotations

import json

from statechat.api_request import ApiError
from statechat.api_tools import ENABLE

PART_TYPES = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def input_messages(raw, tools_on: bool) -> list[dict]:
    """`input` as chat messages: a string is one user message; each item of a list is a
    message ({role, content: a string or text parts}), a function_call (joined to the
    assistant message before it, else an assistant message of its own), a function_call_output
    (a tool message) or a reasoning item (the next assistant message's reasoning_content)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": _unicode(raw, "input")}]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "input must be a string or a non-empty array of items", "input")
    out, reasoning = [], ""
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object (a message or another item)", where)
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output") and not tools_on:
            raise ApiError(400, f"{where}: {kind} items need tools, which are not enabled here "
                                f"({ENABLE})", where)
        if kind == "reasoning":
            reasoning += _reasoning_text(item, where)
            continue
        if kind == "message":
            message = {"role": _role(item, where), "content": _text(item.get("content"),
                                                                    f"{where}.content")}
        elif kind == "function_call":
            message = _call(item, where)
            if out and out[-1]["role"] == "assistant" and not reasoning:
                out[-1].setdefault("tool_calls", []).extend(message["tool_calls"])
                continue
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": _string(item, "call_id", where),
                       "content": _text(item.get("output"), f"{where}.output")}
        else:
            raise ApiError(400, f"{where}.type {str(kind)[:40]!r} is not supported: give "
                                "message, function_call, function_call_output or reasoning "
                                "items", f"{where}.type")
        if reasoning and message["role"] == "assistant":
            message["reasoning_content"], reasoning = reasoning, ""
        out.append(message)
    if not out:
        raise ApiError(400, "input holds no message", "input")
    return out


def _role(item: dict, where: str) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got "
                            f"{str(role)[:40]!r}", f"{where}.role")
    return "system" if role == "developer" else role


def _text(content, where: str) -> str:
    """A content (a string, or a list of text parts) as one string."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{j}] must be a text part ({{\"type\": "
                                    f"\"input_text\", \"text\": ...}}): this server takes text "
                                    f"only, got type {str(kind)[:40]!r}", f"{where}[{j}]")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{where} must be a string or an array of text parts", where)
    return _unicode(content, where)


def _unicode(text: str, where: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:  # (JSON's \ud800 escapes make lone surrogates)
        raise ApiError(400, f"{where} is not valid Unicode (a lone surrogate)", where) from None
    return text


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _call(item: dict, where: str) -> dict:
    """A function_call item as an assistant message with its one tool call."""
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    arguments = item.get("arguments") or "{}"
    try:
        is_object = isinstance(arguments, str) and isinstance(json.loads(arguments), dict)
    except (ValueError, RecursionError):
        is_object = False
    if not is_object:
        raise ApiError(400, f"{where}.arguments must be a string of a JSON object",
                       f"{where}.arguments")
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text (its reasoning_text parts; its summary where it has none)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"),
                                                                                 str)
                                              for p in parts):
        raise ApiError(400, f"{where}.content must be an array of reasoning_text parts",
                       f"{where}.content")
    return "".join(p["text"] for p in parts)
