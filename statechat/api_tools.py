"""A chat request's `tools` and `tool_choice`, checked, for a server started with
`--tool-call-parser qwen3_coder` (off by default, as in vLLM). The tools go to the chat template
as transformers' apply_chat_template gives them (`tools`, OpenAI's function tools as sent); the
reply is parsed for calls (api_tool_calls.py) when the request has tools and its tool_choice is
"auto" (or left out). tool_choice "none" renders the tools (as vLLM does by default) and parses
nothing; "required" and a named function are a 400 (they would need guided decoding). Without
the flag, tools, tool calls and tool messages are a 400 that names it. `statechat batch` takes
the same flag and reads its lines' tools with the same functions (a 400's message is the line's
error)."""

from __future__ import annotations

import dataclasses

from statechat.api_request import ApiError
from statechat.errors import ConfigError

PARSERS = ("qwen3_coder",)  # the names --tool-call-parser takes (vLLM's)
# (the 400s' hint; `batch`'s line errors give it too)
ENABLE = "`statechat serve` and `statechat batch` take them with --tool-call-parser qwen3_coder"
CHOICES = ("auto", "none")  # the tool_choice values served
TOOL_FIELDS = ("tools", "tool_choice")  # the fields parse_tools reads


def check_tool_parser(name: str | None, auto_tool_choice: bool = False) -> str | None:
    """`name` if it is a parser's (None: tools off), given with vLLM's
    --enable-auto-tool-choice or not (`auto_tool_choice`, which needs a parser); a one-line
    ConfigError naming the choices or the flag else (before a model loads)."""
    if name is not None and name not in PARSERS:
        raise ConfigError(f"--tool-call-parser must be {' or '.join(PARSERS)}, got {name!r}")
    if auto_tool_choice and name is None:
        raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser {PARSERS[0]}")
    return name


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools: `tools` for the template (None: none given), and
    whether its reply is parsed for calls (`is_parsed`)."""

    tools: list[dict] | None = None
    is_parsed: bool = False


def parse_tools(body: dict, parser: str | None) -> ToolRequest | None:
    """The body's tools and tool_choice (None when `parser` is None: tools off); ApiError(400)
    naming the field at fault, and then for any of them but an empty tools, or tool_choice
    auto or none."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if parser is None:
        if tools not in (None, []):
            raise ApiError(400, f"tools are not enabled here: {ENABLE}", "tools")
        if choice not in (None, *CHOICES):
            raise ApiError(400, f"tool_choice {choice!r} is not supported: tools are not enabled "
                                f"here ({ENABLE})", "tool_choice")
        return None
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be an array of function tools", "tools")
    for i, tool in enumerate(tools or ()):
        _check_tool(tool, i)
    if choice not in (None, *CHOICES):
        if choice == "required" or isinstance(choice, dict):
            which = '"required"' if choice == "required" else "naming a function"
            raise ApiError(400, f"tool_choice {which} is not supported by this server; use "
                                "auto or none", "tool_choice")
        raise ApiError(400, "tool_choice must be auto or none", "tool_choice")
    return ToolRequest(tools or None, bool(tools) and choice != "none")


def _check_tool(tool, i: int) -> None:
    """ApiError(400) naming the field of tools[i] that is not an OpenAI function tool's."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ApiError(400, f'{where} must be an object of type "function"', where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ApiError(400, f"{where}.function must be an object with a name", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip() or "\n" in name or ">" in name:
        raise ApiError(400, f"{where}.function.name must be a name on one line",
                       f"{where}.function.name")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict,
                                                                "an object (a JSON schema)")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise ApiError(400, f"{where}.function.{key} must be {what}",
                           f"{where}.function.{key}")
