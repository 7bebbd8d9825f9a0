"""A chat request's messages, checked: their roles and text, an assistant's tool calls and the
tools' answers (with tools on: api_tools.py), and whether the reply continues the last one
(vLLM's continue_final_message). Every bad message is an ApiError (400) naming it."""

from __future__ import annotations

import json

from statechat.api_request import ApiError, parse_flag
from statechat.api_tools import ENABLE
from statechat.chat.template import ROLES, TOOL_ROLE


def _content(msg: dict, i: int) -> str:
    content = msg.get("content")
    if content is None and msg.get("role") == "assistant":
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                       f"messages[{i}].content")
    try:
        content.encode()
    except UnicodeEncodeError:  # JSON's \ud800 escapes make lone surrogates
        raise ApiError(400, f"messages[{i}].content is not valid Unicode (a lone surrogate)",
                       f"messages[{i}].content") from None
    return content


def parse_messages(raw, tools: bool = False) -> list[dict]:
    """The body's messages as [{"role", "content"}] (developer is system; text parts joined; an
    assistant message's reasoning, sent back, as "reasoning_content"). With `tools` (the
    server's --tool-call-parser), an assistant's `tool_calls` (their arguments as a mapping,
    as templates read them) and `tool` messages (with their tool_call_id) too; without, each
    is a 400 that says how to enable them."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise ApiError(400, f"messages[{i}] must be an object with a role and a content",
                           f"messages[{i}]")
        role = msg.get("role")
        role = "system" if role == "developer" else role
        if not tools and (msg.get("tool_calls") or role == TOOL_ROLE):  # (dropping them would
            # answer another conversation)
            field, what = ((f"messages[{i}].tool_calls", "tool calls") if msg.get("tool_calls")
                           else (f"messages[{i}].role", "tool messages"))
            raise ApiError(400, f"{field}: {what} are not enabled here ({ENABLE})", field)
        if role not in (*ROLES, TOOL_ROLE):
            taken = (*ROLES[:1], "developer", *ROLES[1:], *((TOOL_ROLE,) if tools else ()))
            given = repr(msg.get("role"))  # (cut: a role may be a string of megabytes)
            given = given if len(given) <= 40 else given[:37] + "..."
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(taken)}, got "
                                f"{given}", f"messages[{i}].role")
        out.append({"role": role, "content": _content(msg, i), **_reasoning(msg, role, i),
                    **_tool_fields(msg, role, i)})
    return out


def _tool_fields(msg: dict, role: str, i: int) -> dict:
    """An assistant's {"tool_calls"} (arguments as mappings) or a tool message's
    {"tool_call_id", "name"}, as given; {} where there are none. A tool message needs its
    tool_call_id (OpenAI's rule), and only an assistant's message may carry tool calls."""
    if role == TOOL_ROLE:
        if msg.get("tool_call_id") is None:
            raise ApiError(400, f"messages[{i}].tool_call_id is missing: a tool message answers "
                                "the call of that id", f"messages[{i}].tool_call_id")
        fields = {k: msg[k] for k in ("tool_call_id", "name") if msg.get(k) is not None}
        for key, value in fields.items():
            if not isinstance(value, str):
                raise ApiError(400, f"messages[{i}].{key} must be a string",
                               f"messages[{i}].{key}")
        return fields
    calls = msg.get("tool_calls")
    if not calls:
        return {}
    if role != "assistant":  # (dropping them would answer another conversation)
        raise ApiError(400, f"messages[{i}].tool_calls: only an assistant message makes tool "
                            "calls", f"messages[{i}].tool_calls")
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be an array",
                       f"messages[{i}].tool_calls")
    return {"tool_calls": [_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                           for j, call in enumerate(calls)]}


def _tool_call(call, where: str) -> dict:
    """One tool call of an assistant message, its arguments (a JSON string, as OpenAI sends
    them, or an object; empty or null: none) as a mapping, as vLLM gives templates."""
    if not isinstance(call, dict):
        raise ApiError(400, f"{where} must be an object with a function (a name and its "
                            "arguments)", where)
    function = call.get("function")
    if not isinstance(function, dict):
        raise ApiError(400, f"{where}.function must be an object (a name and its arguments)",
                       f"{where}.function")
    if not isinstance(function.get("name"), str) or not function["name"].strip():
        raise ApiError(400, f"{where}.function.name must be a function's name",
                       f"{where}.function.name")
    if call.get("type", "function") != "function":
        raise ApiError(400, f'{where}.type must be "function"', f"{where}.type")
    if not isinstance(call.get("id", ""), str):
        raise ApiError(400, f"{where}.id must be a string", f"{where}.id")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # (nested past json's stack: not taken either)
            arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object (or a string of "
                            "one)", f"{where}.function.arguments")
    made = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    return {"id": call["id"], **made} if call.get("id") is not None else made


def _reasoning(msg: dict, role: str, i: int) -> dict:
    """An assistant message's reasoning as the template reads it ({"reasoning_content": text},
    Qwen's templates render it in the turns after the last user message), from either name a
    reasoning parser gives it (`reasoning`, `reasoning_content`); {} where there is none."""
    given = {k: msg[k] for k in ("reasoning_content", "reasoning") if msg.get(k) is not None}
    if role != "assistant" or not given:
        return {}
    for name, text in given.items():  # (the 400 names the field at fault)
        if not isinstance(text, str):
            raise ApiError(400, f"messages[{i}].{name} must be a string",
                           f"messages[{i}].{name}")
    name, text = next(iter(given.items()))
    if given.get("reasoning", text) != text:
        raise ApiError(400, f"messages[{i}].reasoning must be the same text as messages[{i}]."
                            "reasoning_content where both are given", f"messages[{i}].reasoning")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ApiError(400, f"messages[{i}].{name} is not valid Unicode (a lone surrogate)",
                       f"messages[{i}].{name}") from None
    return {"reasoning_content": text}


def continues_final_message(body: dict, messages: list[dict]) -> bool:
    """Whether the reply continues the last (assistant) message: vLLM's continue_final_message,
    with add_generation_prompt false. A closed assistant turn with no generation prompt, which
    the engine's rendering does not make, is a 400."""
    if parse_flag(body, "continue_final_message"):
        if parse_flag(body, "add_generation_prompt", True):
            raise ApiError(400, "continue_final_message needs add_generation_prompt false",
                           "add_generation_prompt")
        if messages[-1]["role"] != "assistant":
            raise ApiError(400, "continue_final_message needs an assistant message last",
                           "messages")
        return True
    if not parse_flag(body, "add_generation_prompt", True):
        raise ApiError(400, "add_generation_prompt false is supported only with "
                            "continue_final_message true", "add_generation_prompt")
    return False
