"""POST /v1/responses (OpenAI's Responses API), read as a chat completion: a body's `input` (a
string, or message, function_call, function_call_output and reasoning items), its `instructions`
(a system message first, joined to an opening system or developer message) and the conversation
of its `previous_response_id` (api_responses_store.py) become a chat body's `messages`;
`max_output_tokens`, `temperature`, `top_p`, `text.format`, `tools` (flat function tools),
`tool_choice`, `parallel_tool_calls` (false: one call at most, echoed as honoured) and
`reasoning.effort` become the chat fields that api_chat.chat_request already checks and
serves. Its errors name the Responses field (`renamed`). Fields this server cannot
honour are 400s (NOT_SUPPORTED); fields it does not know are logged and left out, as the chat
API's are."""

from __future__ import annotations

import dataclasses
import re

from statechat.api_request import BOOL_FIELDS, IGNORED_FIELDS, NUMBER_FIELDS, ApiError
from statechat.api_responses_input import input_messages

# the fields this API reads (vLLM's sampling extras too: seed, top_k, ... and ignore_eos)
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
    "text", "tools", "tool_choice", "reasoning", "parallel_tool_calls", "metadata", "user",
    "store", "previous_response_id", "include", "truncation", "background", "conversation",
    "prompt", "max_tool_calls", "top_logprobs", *NUMBER_FIELDS, *BOOL_FIELDS,
}) | IGNORED_FIELDS
# Responses fields this server cannot honour, and the values that leave them off (any other
# is a 400); () : only null
NOT_SUPPORTED = {"background": (False,), "conversation": (), "prompt": (),
                 "truncation": ("disabled",), "max_tool_calls": (), "top_logprobs": (0,)}
INCLUDE_TAKEN = ("reasoning.encrypted_content",)  # (reasoning items carry their text in plain)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")
# (chat field names in the errors chat_request raises -> this API's)
RENAMES = ((re.compile(r"response_format\.json_schema\."), "text.format."),
           (re.compile(r"response_format\b"), "text.format"),
           (re.compile(r"\b(tools\[\d+\])\.function\."), r"\1."),
           (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
           (re.compile(r'chat_template_kwargs \{"enable_thinking": false\}'),
            'reasoning {"effort": "none"}'),
           (re.compile(r"\bchat_template_kwargs\b"), "reasoning"),
           (re.compile(r"\bmessages\b"), "input"))


@dataclasses.dataclass
class ResponsesRequest:
    """A Responses body, read: the chat body that makes its reply, the conversation to store
    with it (`history`: the previous response's, then this input, without instructions, which
    OpenAI does not carry over), and what the response echoes."""

    chat_body: dict
    history: list[dict]
    echo: dict
    is_stream: bool
    is_stored: bool


def parse_responses(body: dict, previous: list[dict] | None, tools_on: bool) -> ResponsesRequest:
    """The request of a Responses `body`; `previous`: the stored conversation of its
    previous_response_id (the caller's 404 when there is none); `tools_on`: whether the server
    parses tool calls. ApiError(400) naming the field at fault."""
    _refuse_unsupported(body)
    history = [*(previous or []), *input_messages(body.get("input"), tools_on)]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string", "instructions")
    chat = {"model": body.get("model"), "messages": _instructed(instructions, history),
            **{k: body[k] for k in (*NUMBER_FIELDS, *BOOL_FIELDS) if k in body}}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat.update(_tools(body.get("tools"), body.get("tool_choice")))
    if body.get("parallel_tool_calls") is not None:  # (checked by _check_echoed, and the chat's)
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    chat.update(_text_format(body.get("text")))
    chat.update(_reasoning(body.get("reasoning")))
    _check_echoed(body)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "metadata": body.get("metadata") or {}, "user": body.get("user"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "reasoning": {"effort": None, "summary": None, **(body.get("reasoning") or {})},
            "truncation": "disabled", "store": body.get("store") is not False}
    return ResponsesRequest(chat, history, echo, body.get("stream") is True, echo["store"])


def _instructed(instructions: str | None, history: list[dict]) -> list[dict]:
    """The conversation with the instructions as its system message first, joined (a blank
    line between) to a system or developer message that opens it: a chat template such as
    Qwen3.5's takes one system message, at the start, and refused the two."""
    if not instructions:
        return history
    if history and history[0]["role"] == "system":
        opening = {**history[0], "content": f"{instructions}\n\n{history[0]['content']}"}
        return [opening, *history[1:]]
    return [{"role": "system", "content": instructions}, *history]


def renamed(e: ApiError) -> ApiError:
    """`e` (a chat_request error) with the chat fields it names written as this API's."""
    message, param = e.message, e.param
    for pattern, name in RENAMES:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param else param
    return ApiError(e.status, message, param, e.code, e.kind, e.headers)


def _refuse_unsupported(body: dict) -> None:
    for key, offs in NOT_SUPPORTED.items():
        value = body.get(key)
        if value is not None and not any(value == off and type(value) is type(off)
                                         for off in offs):
            raise ApiError(400, f"{key} is not supported by this server; leave it out", key)
    include = body.get("include")
    if include is not None and (not isinstance(include, list)
                                or any(v not in INCLUDE_TAKEN for v in include)):
        raise ApiError(400, f"include may hold only {', '.join(INCLUDE_TAKEN)} here (reasoning "
                            "items carry their text)", "include")


def previous_id(body: dict) -> str | None:
    """The body's previous_response_id (None: none given); ApiError(400) where it is no
    string (an id is looked up only once it is one)."""
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise ApiError(400, "previous_response_id must be a string", "previous_response_id")
    return previous


def _check_echoed(body: dict) -> None:
    """The fields a response repeats, of the types OpenAI gives them (metadata: strings)."""
    for key, what in (("metadata", dict), ("store", bool), ("stream", bool),
                      ("parallel_tool_calls", bool), ("user", str)):
        if body.get(key) is not None and not isinstance(body[key], what):
            kind = {dict: "an object", bool: "true or false", str: "a string"}[what]
            raise ApiError(400, f"{key} must be {kind}", key)
    for key, value in (body.get("metadata") or {}).items():
        if not isinstance(value, str):
            raise ApiError(400, f"metadata.{str(key)[:64]} must be a string (metadata maps "
                                "keys to strings)", f"metadata.{str(key)[:64]}")


def _tools(tools, choice) -> dict:
    """Flat function tools and tool_choice as the chat API's fields."""
    out = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "tools must be an array of function tools", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise ApiError(400, f"tools[{i}].type {str(kind)[:40]!r} is not supported: this "
                                    "server calls function tools only", f"tools[{i}].type")
        out["tools"] = [{"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}}
            for tool in tools]
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, 'tool_choice must be "auto", "none", "required" or {"type": '
                                '"function", "name": ...}', "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and choice not in ("auto", "none", "required"):
        raise ApiError(400, 'tool_choice must be "auto", "none", "required" or {"type": '
                            '"function", "name": ...}', "tool_choice")
    return {**out, "tool_choice": choice} if choice is not None else out


def _text_format(text) -> dict:
    """`text` ({format, verbosity}) as the chat API's response_format."""
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise ApiError(400, "text must be an object ({\"format\": ...})", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError(400, "text.verbosity is not supported by this server; leave it out or "
                            "give \"medium\"", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        if fmt.get("schema") is None:  # (else any JSON would pass for the schema left out)
            raise ApiError(400, "text.format.schema is required: the JSON schema the reply is "
                                "held to, in text.format itself (not nested under json_schema "
                                "as the chat API's response_format has it)",
                           "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    return {"response_format": fmt}


def _reasoning(reasoning) -> dict:
    """reasoning.effort "none" turns thinking off (the template's enable_thinking), another
    effort turns it on; summary is taken (no summary is made: the reasoning comes whole)."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, dict):
        raise ApiError(400, "reasoning must be an object ({\"effort\": ...})", "reasoning")
    for key, values in (("effort", EFFORTS), ("summary", SUMMARIES)):
        if reasoning.get(key) is not None and reasoning[key] not in values:
            raise ApiError(400, f"reasoning.{key} must be one of {', '.join(values)}",
                           f"reasoning.{key}")
    effort = reasoning.get("effort")
    return {} if effort is None else {"chat_template_kwargs": {"enable_thinking":
                                                                effort != "none"}}
