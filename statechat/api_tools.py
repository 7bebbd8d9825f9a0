"""A chat request's `tools` and `tool_choice`, checked, for a server started with
`--tool-call-parser qwen3_coder` (off by default, as in vLLM). The tools go to the chat template
as transformers' apply_chat_template gives them (`tools`, OpenAI's function tools as sent); the
reply is parsed for calls (api_tool_calls.py) when the request has tools and its tool_choice is
not "none". tool_choice "none" renders the tools (as vLLM does by default) and parses nothing.

"required" and a named function ({"type": "function", "function": {"name": X}}) start the
reply with the opening of a call, in Qwen3.5's format (`force_call`): `<tool_call>` and a
newline for "required" (the model names the function), that and `<function=X>` and a newline
for X. The forced text goes to the engine as prompt tokens after the generation prompt (so
`usage` counts it in prompt_tokens), and the reply is parsed as the forced text followed by the
generated text (ToolRequest.forced), so a call comes back as `tool_calls`, as with "auto". A
prompt that opens a think block is first rendered again with `enable_thinking` false (as
Qwen's templates close an empty one), or, where the template ignores that, has the block
closed empty: a forced call is made without reasoning (so its grammar, below, holds the reply
from its first token). A function that is not among the tools, or "required" with no tools,
is a 400 naming tool_choice.

What follows the opening is held, as vLLM's structured outputs hold a forced call, to a
grammar of the call (api_tool_grammar.hold_call, the request's structured output): for X, X's
parameters as its `parameters` schema describes them, then the call's end; for "required",
one or more calls, each to one of the tools by name, and nothing after them. The arguments
parsed are then valid against the schema (api_tool_grammar.py says what is held: required
parameters always, in the schema's `properties` order; values typed as the parser reads them;
a string's enum and lengths, not its pattern). A schema the grammar cannot hold leaves the
call unheld (logged), as it was before: then a continuation that makes no call (a model that
writes no `<function=NAME>` after "required"'s opening) gives what "auto" gives for the same
text, the forced opening and the rest as content, nothing lost. A held call is one grammar
for the reply: a request's own structured output beside it (response_format, guided_json ...)
is a 400 naming tool_choice (api_structured.check_with_tools), and min_tokens a 400 naming it
(the grammar decides where the reply ends).

A named function gets exactly one call, as vLLM's guided decoding and OpenAI give it
(`end_at_call`): `</tool_call>` is added to the request's stop strings, so the reply ends where
the model closes the call (a second call or text after it is never generated; the parser reads
the call whole without its closing tag), with finish_reason "stop" (OpenAI's and vLLM's for a
named function; "required" and "auto" say "tool_calls") and stop_reason null, as for the
model's own end (the stop is the server's, not the request's); completion_tokens counts the
tokens generated, the closing tag's included. A request's own stop strings still apply: one
that matches inside the call ends it there (the call holds the parameters read so far,
stop_reason names that stop), as max_tokens does (finish_reason "length"); for an unheld call,
min_tokens holds the call's end off as it holds off every stop (vLLM's rule), so a reply
shorter than it may go on past the call. With 64 stop strings (MAX_STOPS) already, a named
function (or parallel_tool_calls false, below) is a 400 naming stop. "required" makes one or
more calls (vLLM's rule); unheld, the model may then write whatever it writes, as "auto"
reads it.

`parallel_tool_calls` (true or false, true when left out or null; another value is a 400
naming it) false makes at most one call, as OpenAI's and vLLM's: "required" is held to exactly
one call, and "auto" and "required" end where the first call closes, by the same stop as a
named function's (end_at_call), with finish_reason "tool_calls" where a call was made ("stop"
where the reply closed no call: the model wrote the closing tag alone) and stop_reason null.
It changes nothing with tool_choice "none" or without tools. The Responses API passes its own
field on; Anthropic's `tool_choice.disable_parallel_tool_use` true is it false.

Without the flag, tools, tool calls, tool messages and a tool_choice other than auto or none
are a 400 that names it. `statechat batch` takes the same flag and reads its lines' tools with
the same functions (a 400's message is the line's error)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

from statechat.api_request import ApiError, parse_flag
from statechat.api_tool_calls import CALL_CLOSE, CALL_OPEN, FUNC_OPEN, MAX_NAME
from statechat.engine.sampling import MAX_STOPS, SamplingParams
from statechat.errors import ConfigError

PARSERS = ("qwen3_coder",)  # the names --tool-call-parser takes (vLLM's)
# (the 400s' hint; `batch`'s line errors give it too)
ENABLE = "`statechat serve` and `statechat batch` take them with --tool-call-parser qwen3_coder"
CHOICES = ("auto", "none")  # the tool_choice values served without the flag
REQUIRED = "required"  # (and a named function: served with it, by a forced, held call)
CLOSE_THINKING = "\n</think>\n\n"  # (what a prompt still in its think block gets before one)
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # the fields parse_tools reads


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
    """What a chat request asks of tools: `tools` for the template (None: none given),
    whether its reply is parsed for calls (`is_parsed`), and the opening of a call its reply is
    made to begin with (`forced`, "" for none: tool_choice "required" or a named function),
    which goes into the prompt and is parsed as the reply's start. `stop`: a stop string the
    server added to the request's own (end_at_call's), whose match is reported as no
    stop_reason (None: none added). `is_parallel`: the request's parallel_tool_calls (false:
    one call at most)."""

    tools: list[dict] | None = None
    is_parsed: bool = False
    forced: str = ""
    stop: str | None = None
    is_parallel: bool = True

    @property
    def is_one_call(self) -> bool:
        """Whether the reply ends where its first call closes (end_at_call): a named
        function's, or parsed with parallel calls off."""
        return self.is_parsed and (self.is_named or not self.is_parallel)

    @property
    def is_named(self) -> bool:
        """Whether tool_choice named the function (its opening names it): one call is made."""
        return FUNC_OPEN in self.forced

    @property
    def function_name(self) -> str | None:
        """The function tool_choice named (None: none named)."""
        if not self.is_named:
            return None
        return self.forced.split(FUNC_OPEN, 1)[1].partition(">")[0]


def parse_tools(body: dict, parser: str | None) -> ToolRequest | None:
    """The body's tools, tool_choice and parallel_tool_calls (None when `parser` is None: tools
    off); ApiError(400) naming the field at fault (with `parser` None, for tools but an empty
    one, or tool_choice but auto or none; parallel_tool_calls that is not true or false)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    is_parallel = parse_flag(body, "parallel_tool_calls", True)
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
    forced = _forced(choice, tools or [])
    return ToolRequest(tools or None, bool(tools) and choice != "none", forced,
                       is_parallel=is_parallel)


def _forced(choice, tools: list[dict]) -> str:
    """The call opening a (checked) tool_choice forces on the reply ("" for auto, none or
    none given); ApiError(400) naming tool_choice for another value, "required" with no
    tools, or a function that is not among `tools`."""
    if choice in (None, *CHOICES):
        return ""
    if choice == REQUIRED:
        if not tools:
            raise ApiError(400, 'tool_choice "required" needs tools to call; give tools',
                           "tool_choice")
        return CALL_OPEN + "\n"
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise ApiError(400, 'tool_choice must be "auto", "none", "required" or {"type": '
                            '"function", "function": {"name": ...}}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise ApiError(400, f"tool_choice names the function {name[:80]!r}, which is not among "
                            "tools", "tool_choice")
    return f"{CALL_OPEN}\n{FUNC_OPEN}{name}>\n"


def end_at_call(params: SamplingParams, tools: ToolRequest | None,
                ) -> tuple[SamplingParams, ToolRequest | None]:
    """(`params`, `tools`) of a request that makes one call (ToolRequest.is_one_call: a named
    function, or parallel_tool_calls false) made to end where its first call ends, as guided
    decoding ends a named one: CALL_CLOSE among the stop strings (the engine cuts the reply
    before it; the parser reads a call whole without it), and `tools.stop` set to it where the
    request's own stops did not have it. Another request's, as they are. ApiError(400) naming
    stop where the request gave MAX_STOPS of them already (one more is the call's end)."""
    if tools is None or not tools.is_one_call or CALL_CLOSE in params.stop:
        return params, tools
    if len(params.stop) >= MAX_STOPS:
        raise ApiError(400, f"stop may hold at most {MAX_STOPS - 1} strings where the reply "
                            "makes one tool call (the call's end is one more)", "stop")
    return (dataclasses.replace(params, stop=(*params.stop, CALL_CLOSE)),
            dataclasses.replace(tools, stop=CALL_CLOSE))


def unthinking(template_kwargs: dict | None) -> dict:
    """Template variables with `enable_thinking` false over `template_kwargs` (a request's,
    merged and checked: an object or None)."""
    return {**(template_kwargs or {}), "enable_thinking": False}


def force_call(ids: list[int], tools: ToolRequest | None, tokenizer,
               render_unthinking: Callable[[], list[int]],
               lock: contextlib.AbstractContextManager | None = None) -> list[int]:
    """The prompt `ids` (rendered, ending with its generation prompt) with the token ids of
    `tools.forced` after it (`ids` as they are where nothing is forced). A prompt that opens a
    think block (chat/template.opens_thinking) is first rendered again by `render_unthinking`
    (the same conversation with `unthinking` variables), and where that still opens one, its
    block is closed empty (CLOSE_THINKING) before the forced text, the prompt's white space
    before it encoded with it (as the template's own empty block is). `lock` (reusable, such as a
    threading.Lock) is held while `tokenizer` is used, not while rendering."""
    from statechat.chat.template import opens_thinking

    if tools is None or not tools.forced:
        return ids
    lock = lock if lock is not None else contextlib.nullcontext()
    with lock:
        opened = opens_thinking(tokenizer, ids)
    if opened:
        ids = render_unthinking()
        with lock:
            opened = opens_thinking(tokenizer, ids)
    with lock:
        if opened:  # (the prompt's last newline goes with the closing: Qwen's "\n\n" token)
            ids, tail = _without_blank_tail(ids, tokenizer)
            return [*ids, *tokenizer.encode(tail + CLOSE_THINKING + tools.forced,
                                            add_special_tokens=False)]
        return [*ids, *tokenizer.encode(tools.forced, add_special_tokens=False)]


def _without_blank_tail(ids: list[int], tokenizer, most: int = 4) -> tuple[list[int], str]:
    """`ids` less the tokens of white space alone that end them (at most `most`), and their
    text: encoded again with the text after it, as the template's text is encoded whole."""
    k = len(ids)
    while k > max(0, len(ids) - most):
        piece = tokenizer.decode(ids[k - 1:k], skip_special_tokens=False)
        if not piece or piece.strip():
            break
        k -= 1
    return ids[:k], tokenizer.decode(ids[k:], skip_special_tokens=False)


def _check_tool(tool, i: int) -> None:
    """ApiError(400) naming the field of tools[i] that is not an OpenAI function tool's."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ApiError(400, f'{where} must be an object of type "function"', where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ApiError(400, f"{where}.function must be an object with a name", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip() or name != name.strip() \
            or any(c in name for c in "\n<>") or len(name) > MAX_NAME:
        # (the parser reads no call of such a name: its calls would be content)
        raise ApiError(400, f"{where}.function.name must be a name on one line, without < or >"
                            f" or white space at its ends, of at most {MAX_NAME} characters",
                       f"{where}.function.name")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict,
                                                                "an object (a JSON schema)")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise ApiError(400, f"{where}.function.{key} must be {what}",
                           f"{where}.function.{key}")
