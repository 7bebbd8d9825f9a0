"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), read as a chat
completion: an Anthropic body is turned into the chat API's body (`chat_body`), which the chat
path then checks, renders and samples as its own (api_chat.chat_request), so both APIs give
the same prompt for the same conversation. The answer's side is api_anthropic_answer.py's.

The mapping: `system` (a string or text blocks, joined) is a system message first; a user
message's text blocks are its content (joined, as the chat API joins text parts) and each
`tool_result` block a tool message (its text, `Error: ` before it where `is_error`); an
assistant message's text, `thinking` (its reasoning, sent back) and `tool_use` blocks are its
content, reasoning_content and tool_calls; a last assistant message is a prefill the reply
continues (vLLM's continue_final_message). `tools` ({name, description, input_schema}) are
function tools; tool_choice auto, any, tool (a name) and none are the chat API's "auto",
"required", a named function and "none" (its `disable_parallel_tool_use` true is
parallel_tool_calls false: one tool_use at most); `thinking` enabled (or adaptive) or disabled
is the template's `enable_thinking` (its budget_tokens is not enforced); `stop_sequences` is
`stop`; `output_config.format` (or the beta's `output_format`) is a json_schema
`response_format`.
Errors the chat path raises name Anthropic's fields (`renamed_errors`), and every error of
these routes has Anthropic's shape (`error_body`)."""

from __future__ import annotations

import contextlib
import re

from statechat.api_anthropic_messages import chat_messages, system_text
from statechat.api_request import ApiError, check_model

MESSAGES_ROUTE, COUNT_ROUTE = "/v1/messages", "/v1/messages/count_tokens"
ANTHROPIC_ROUTES = (MESSAGES_ROUTE, COUNT_ROUTE)
# the body's fields passed to the chat path as they are (the last five: vLLM's sampling extras)
PASSED = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "seed", "min_p",
          "repetition_penalty", "presence_penalty", "frequency_penalty")
# the fields these routes read (a body's others are logged as unknown, and left out)
MESSAGES_FIELDS = frozenset({*PASSED, "messages", "system", "stop_sequences", "metadata",
                             "tools", "tool_choice", "thinking", "output_config", "output_format"})
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # (and "tool": a name)
THINKING = {"enabled": True, "adaptive": True, "disabled": False}  # -> enable_thinking
# Anthropic's error type of each status (api_error for another 5xx, invalid_request_error else)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    """`error` as Anthropic's error object: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(error.status)
    kind = kind or ("api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def chat_body(body: dict, tools_on: bool, count_only: bool = False) -> tuple[dict, list]:
    """The chat API's body for an Anthropic body, and where each of its messages came from
    (the index of the Anthropic message, or None for `system`); `tools_on`: the server parses
    tool calls (without, a tool block is a 400 naming the flag); `count_only`: count_tokens'
    body, which has no max_tokens. ApiError(400) naming the field at fault."""
    check_model(body)
    if not count_only and body.get("max_tokens") is None:
        raise ApiError(400, "max_tokens is required: the most tokens the reply may have",
                       "max_tokens")
    _check_metadata(body.get("metadata"))
    messages, origin = [], []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": system_text(body["system"])})
        origin.append(None)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    for i, message in enumerate(raw):
        made = chat_messages(message, i, tools_on)
        messages += made
        origin += [i] * len(made)
    chat = {key: body[key] for key in (("model",) if count_only else PASSED) if key in body}
    chat["messages"] = messages
    if raw[-1].get("role") == "assistant":  # (a prefill: the reply goes on from it)
        chat.update(continue_final_message=True, add_generation_prompt=False)
    if body.get("stop_sequences") is not None:
        chat["stop"] = _stop_sequences(body["stop_sequences"])
    chat.update(_tools(body.get("tools"), body.get("tool_choice")))
    if (enable := _thinking(body.get("thinking"))) is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": enable}
    if (schema := _output_schema(body)) is not None:
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": schema}}
    return chat, origin


def _check_metadata(metadata) -> None:
    """Anthropic's metadata: an object whose user_id (the one key it has) is a string."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise ApiError(400, "metadata must be an object ({\"user_id\": ...})", "metadata")
    if metadata.get("user_id") is not None and not isinstance(metadata["user_id"], str):
        raise ApiError(400, "metadata.user_id must be a string", "metadata.user_id")


def _stop_sequences(stops) -> list[str]:
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop_sequences must be an array of non-empty strings",
                       "stop_sequences")
    return stops


def _tools(tools, choice) -> dict:
    """The chat API's {"tools", "tool_choice", "parallel_tool_calls"} of Anthropic's (custom
    tools only; tool_choice's disable_parallel_tool_use true or false)."""
    chat = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "tools must be an array of tools", "tools")
        chat["tools"] = [_tool(tool, i) for i, tool in enumerate(tools)]
    if choice is None:
        return chat
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in TOOL_CHOICES:
        chat["tool_choice"] = TOOL_CHOICES[kind]
    else:
        raise ApiError(400, 'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": '
                            '"none"} or {"type": "tool", "name": ...}', "tool_choice")
    if kind in ("any", "tool") and not tools:
        raise ApiError(400, f'tool_choice "{kind}" needs tools to call; give tools',
                       "tool_choice")
    if (disable := choice.get("disable_parallel_tool_use")) is not None:
        if not isinstance(disable, bool):
            raise ApiError(400, "tool_choice.disable_parallel_tool_use must be true or false",
                           "tool_choice.disable_parallel_tool_use")
        chat["parallel_tool_calls"] = not disable
    return chat


def _tool(tool, i: int) -> dict:
    """tools[i] as the chat API's function tool; a server tool (a `type` other than custom:
    web search, bash, ...) is a 400, as nothing here would run it."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ApiError(400, f"{where} must be an object with a name and an input_schema", where)
    if tool.get("type") not in (None, "custom"):
        raise ApiError(400, f"{where}.type: {str(tool['type'])[:40]!r} tools (Anthropic's "
                            "server tools) are not supported; give custom tools, with a name "
                            "and an input_schema", f"{where}.type")
    function = {"name": tool.get("name")}
    for key, chat_key in (("description", "description"), ("input_schema", "parameters")):
        if tool.get(key) is not None:
            function[chat_key] = tool[key]
    return {"type": "function", "function": function}


def _thinking(thinking) -> bool | None:
    """enable_thinking for the body's `thinking` (None: the template's default)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING:
        raise ApiError(400, 'thinking must be {"type": "enabled", "budget_tokens": N} or '
                            '{"type": "disabled"}', "thinking.type")
    return THINKING[kind]


def _output_schema(body: dict):
    """The JSON schema the reply is held to: `output_config.format` (`effort` taken, not
    enforced) or the beta's `output_format`, each {"type": "json_schema", "schema"}; None."""
    config, given = body.get("output_config"), body.get("output_format")
    if config is not None and not isinstance(config, dict):
        raise ApiError(400, "output_config must be an object", "output_config")
    if (extra := sorted(set(config or {}) - {"format", "effort"})):
        raise ApiError(400, f"output_config.{extra[0]} is not supported; leave it out",
                       f"output_config.{extra[0]}")
    at = "output_config.format"
    if given is not None:
        if (config or {}).get("format") is not None:
            raise ApiError(400, f"output_format and {at} each give a format: leave one out",
                           "output_format")
        config, at = {"format": given}, "output_format"
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ApiError(400, f'{at}.type must be "json_schema"', f"{at}.type")
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, f"{at}.schema must be a JSON schema (an object)", f"{at}.schema")
    return fmt["schema"]


# the chat path's names of a field that Anthropic's body names otherwise
_FIELD_NAMES = ((r"^stop$", "stop_sequences"),
                (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
                (r"^tools\[(\d+)\]\.function\b", r"tools[\1]"))


@contextlib.contextmanager
def renamed_errors(origin: list, body: dict | None = None):
    """Raise the chat path's ApiErrors with Anthropic's field names: its messages[k] is the
    Anthropic message it came from (`origin`, chat_body's; None: `system`), its stop is
    stop_sequences, its tools' function fields the tool's own, its response_format's schema
    the one of the field `body` (the Anthropic body) gave it in."""
    given = (body or {}).get("output_format") is not None
    schema = (r"^response_format\.json_schema\.schema",
              "output_format.schema" if given else "output_config.format.schema")
    try:
        yield
    except ApiError as e:
        message, param = _renamed(e.message, origin), _renamed(e.param, origin)
        for pattern, name in (schema, *_FIELD_NAMES):
            param = re.sub(pattern, name, param) if param is not None else None
        if e.param is not None and param != _renamed(e.param, origin):
            message = message.replace(_renamed(e.param, origin), param, 1)
        # (api_request's hint to leave max_tokens out: not here, where it is required)
        message = message.replace(", or leave max_tokens out to fill the room", "")
        raise ApiError(e.status, message, param, e.code, e.kind, e.headers) from None


def _renamed(text: str | None, origin: list) -> str | None:
    """`text` with the chat's messages[k] as the Anthropic message it came from."""
    def where(match: re.Match) -> str:
        k = int(match[1])
        at = origin[k] if k < len(origin) else None
        return "system" if at is None else f"messages[{at}]"

    return None if text is None else re.sub(r"messages\[(\d+)\]", where, text)
