"""The grammar that holds a forced tool call (tool_choice "required" or a named function, under
`--tool-call-parser qwen3_coder`) to its function's `parameters` schema, as vLLM's structured
outputs hold one: what follows the call's opening that api_tools.force_call puts in the prompt,
in Qwen3.5's format, as a Lark grammar for llguidance (engine/structured.py's `grammar`), so
that the call parses (api_tool_calls.py) into arguments the schema accepts.

- A named function: its parameters, `</function>` and `</tool_call>`, then only the end of the
  reply. "required": one or more calls (each named after one of the tools, a newline and
  `<tool_call>` between two), then only the end; exactly one with `parallel_tool_calls` false.
- Parameters are written in the order of the schema's `properties`: each name in `required`
  always (one that `properties` lacks is a string, written after them), the others where the
  model chooses; a parameter the schema does not list is never written, so a tool without
  `parameters` (or without `properties`) is called with none, `{}`.
- A value read as a string (api_tool_calls.typed_value: its property's type is string or
  includes it, or it gives no type) is any text without `<parameter=`, `</parameter>`,
  `</function>` or `</tool_call>` (the tags that would end or split it), held to the
  property's string `enum` or `const` and its `minLength`/`maxLength`; `pattern` and `format`
  are not held. Another value is JSON held to its property's schema (llguidance's `%json`, with
  the parameters' `$defs`/`definitions` for its `$ref`s, and the white space response_format's
  JSON gets); a string inside such JSON may still hold a closing tag (rare; the parser then cuts
  the value there).
- A call the grammar cannot describe (a required parameter whose name the parser cannot read,
  a `false` schema, an enum with no string the format can write, a schema llguidance refuses)
  is left unheld, as before this grammar: the opening forced, the arguments whatever the model
  writes; the log says so in one line. An optional such parameter is just never written.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging

from statechat.api_request import ApiError
from statechat.api_tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    FUNC_CLOSE,
    FUNC_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
)
from statechat.engine.sampling import SamplingParams
from statechat.engine.structured import JSON_WHITESPACE, StructuredOutput
from statechat.errors import ConfigError

log = logging.getLogger("statechat.server")

TAGS = (PARAM_OPEN, PARAM_CLOSE, FUNC_CLOSE, CALL_CLOSE)  # (what a string value may not hold)
# a string value: any text holding none of TAGS (the regex's `/` written `\/`)
TEXT = ("/(?s:.*)/ & ~/(?s:.*)(" + "|".join(t.replace("/", "\\/") for t in TAGS)
        + ")(?s:.*)/")
NL = "\n"
VALUE_END = NL + PARAM_CLOSE + NL  # (after a value: Qwen3.5's templates write it so)


class Unheld(Exception):
    """A call (or one parameter of it) that the grammar cannot describe; its text says why."""


def hold_call(params: SamplingParams, tools, tokenizer) -> SamplingParams:
    """`params` with the grammar of the call that `tools` (an api_tools.ToolRequest or None)
    force as their structured output (`params` as they are where none is forced, or where the
    call cannot be held: logged). ApiError(400) naming min_tokens where the request gives it
    (the grammar decides where the reply ends, as with response_format). `tokenizer` (the
    engine's; hold its lock) spells the tags that are one token of their own as that token."""
    if tools is None or not tools.forced:
        return params
    held = call_grammar(tools.tools or [], tools.function_name, tokenizer,
                        is_parallel=tools.is_parallel)
    if held is None:
        return params
    if params.min_tokens:
        raise ApiError(400, 'min_tokens cannot be used with tool_choice "required" or a named '
                            "function: the call's grammar decides where the reply ends",
                       "min_tokens")
    return dataclasses.replace(params, structured=held)


def call_grammar(tools: list[dict], name: str | None, tokenizer,
                 is_parallel: bool = True) -> StructuredOutput | None:
    """The structured output of what follows a forced call's opening: the parameters of the
    function `name`, or (None) one or more calls to any of `tools` (checked function tools;
    one call where not `is_parallel`); None where they cannot be held (logged)."""
    try:
        tags = {tag: _tag(tag, tokenizer) for tag in (CALL_OPEN, CALL_CLOSE)}
        return _compiled(grammar_text(tools, name, tags, is_parallel))
    except Unheld as e:
        choice = f"function {name!r}" if name is not None else '"required"'
        log.warning("statechat: tool_choice %s is served without holding the call to its "
                    "schema: %s", choice, e)
        return None


def grammar_text(tools: list[dict], name: str | None, tags: dict[str, str],
                 is_parallel: bool = True) -> str:
    """The Lark grammar (see the module's docstring); `tags` spells CALL_OPEN and CALL_CLOSE;
    "required" (`name` None) makes one call alone where not `is_parallel`. Unheld where a
    function's call cannot be described."""
    rules = [f"TEXT: {TEXT}", f"close: {tags[CALL_CLOSE]}"]
    end = f"{_lit(FUNC_CLOSE + NL)} close"
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)  # (checked: there)
        rules.insert(0, f"start: {_parameters(tool['function'], 0, rules)} {end}")
        return "\n".join(rules) + "\n"
    calls = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        head = _lit(f"{FUNC_OPEN}{function['name']}>{NL}")
        rules.append(f"call_{i}: {head} {_parameters(function, i, rules)} {end}")
        calls.append(f"call_{i}")
    rules.append(f"call: {' | '.join(calls)}")
    more = f' ("\\n" {tags[CALL_OPEN]} "\\n" call)*' if is_parallel else ""
    rules.insert(0, f"start: call{more}")
    return "\n".join(rules) + "\n"


def _parameters(function: dict, i: int, rules: list[str]) -> str:
    """The rule names, in order, of function i's parameters (`rules` gets their rules); ""
    for none. Unheld where a required one cannot be written."""
    schema = function.get("parameters") or {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    names = list(dict.fromkeys([*properties, *(r for r in required if isinstance(r, str))]))
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    out = []
    for j, pname in enumerate(names):
        try:
            value = _value(properties.get(pname, {}), defs, f"{i}_{j}", rules)
            if not pname or "\n" in pname or "<" in pname or ">" in pname \
                    or pname != pname.strip():
                raise Unheld(f"the parser cannot read a parameter named {pname[:40]!r}")
        except Unheld as e:
            if pname in required:
                raise Unheld(f"{function['name']}'s parameter {pname[:40]!r}: {e}") from None
            continue
        head = _lit(f"{PARAM_OPEN}{pname}>{NL}")
        rules.append(f"p_{i}_{j}: {head} {value}")
        out.append(f"p_{i}_{j}" if pname in required else f"p_{i}_{j}?")
    return " ".join(out)


def _value(prop, defs: dict, key: str, rules: list[str]) -> str:
    """The rule name of a value of property schema `prop` followed by VALUE_END (`rules` gets
    its rules), read as api_tool_calls.typed_value reads it. Unheld where none can be written."""
    if prop is False:
        raise Unheld("its schema is false")
    kind = prop.get("type") if isinstance(prop, dict) else None
    if isinstance(prop, dict) and kind is not None and "string" not in (
            kind if isinstance(kind, list) else [kind]):
        schema = {**{k: v for k, v in defs.items() if k not in prop}, **prop}
        schema.setdefault("x-guidance", {"whitespace_pattern": JSON_WHITESPACE})
        rules.append(f"j_{key}: %json {json.dumps(schema)}")
        rules.append(f"v_{key}: j_{key} {_lit(VALUE_END)}")
        return f"v_{key}"
    prop = prop if isinstance(prop, dict) else {}
    if "enum" in prop or "const" in prop:
        given = prop["enum"] if "enum" in prop else [prop["const"]]
        members = [m for m in (given if isinstance(given, list) else [])
                   if isinstance(m, str) and not any(t in m for t in TAGS)]
        if not members:
            raise Unheld("no string of its enum can be written")
        rules.append(f"v_{key}: ({' | '.join(map(_lit, members))}) {_lit(VALUE_END)}")
        return f"v_{key}"
    low, high = (prop.get(k) for k in ("minLength", "maxLength"))
    low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
    high = high if isinstance(high, int) and not isinstance(high, bool) and high >= 0 else None
    terminal = "TEXT"
    if low or high is not None:
        if high is not None and high < low:
            raise Unheld("its maxLength is below its minLength")
        terminal = f"T_{key}".upper()
        rules.append(f"{terminal}: TEXT & /(?s:.{{{low},{'' if high is None else high}}})/")
    rules.append(f"v_{key}[suffix={_lit(VALUE_END)}]: {terminal}")
    return f"v_{key}"


def _lit(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _tag(tag: str, tokenizer) -> str:
    """`tag` as a grammar spells it: also as its own token where the tokenizer has one for it
    (Qwen3.5's `<tool_call>` and `</tool_call>`, which llguidance takes as special tokens that a
    literal does not match), else as text alone."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    if len(ids) == 1 and ids[0] in added:
        return f"(<[{ids[0]}]> | {_lit(tag)})"
    return _lit(tag)


@functools.lru_cache(maxsize=64)  # (a request's tools are most often the last one's)
def _compiled(text: str) -> StructuredOutput:
    """The structured output of grammar `text`; Unheld where llguidance refuses it."""
    try:
        return StructuredOutput(grammar=text)
    except ConfigError as e:
        raise Unheld(str(e)) from None
