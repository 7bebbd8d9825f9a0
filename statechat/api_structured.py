"""A request's structured output (engine/structured.py): the reply held to a JSON schema, a
regular expression, a list of choices or a grammar, read from the fields that OpenAI's, vLLM's
and llama.cpp's servers take for it, for both APIs and `statechat batch`:

- OpenAI's `response_format`: {"type": "text"} (free), {"type": "json_object"} (any JSON
  object; llama.cpp's "schema" beside it is taken), {"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}} (the schema; none: any JSON object);
- vLLM's `guided_json` (a schema, or its JSON text), `guided_regex`, `guided_choice` (strings),
  `guided_grammar` (GBNF or Lark), and its newer `structured_outputs` object ({"json", "regex",
  "choice", "grammar", "json_object": true}, with "disable_any_whitespace": JSON without white
  space between its tokens; its other back-end options only off);
- llama.cpp's `json_schema` (a schema; {} is any JSON value) and `grammar` (GBNF).

One constraint a request: two are a 400 naming both, and one beside a tool_choice that forces
a call (whose reply is held to the function's schema: api_tool_grammar.py) a 400 naming
tool_choice. A bad one (a schema, regex or grammar that does not compile, a field of the wrong
type) is a 400 naming its field, with the engine's one line. With a reasoning parser, the reply
of a prompt that opens a think block is held to it only after the `</think>` that ends the
thinking (`gate_thinking`), as vLLM's reasoning parsers hold it: the reasoning is free, the
answer (the message's `content`) is what is constrained.
"""

from __future__ import annotations

import dataclasses
import json

from statechat.api_reasoning import CLOSE
from statechat.api_request import STRUCTURED_FIELDS, ApiError
from statechat.engine.sampling import SamplingParams
from statechat.engine.structured import StructuredOutput
from statechat.errors import ConfigError

__all__ = ["STRUCTURED_FIELDS", "check_with_tools", "gate_thinking", "parse_structured"]
# vLLM's structured_outputs keys, as StructuredOutput's fields ("json_object": json true)
OUTPUT_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json"}
# vLLM's options of its own back ends: taken at the values that leave them off
OFF_OPTIONS = ("disable_fallback", "disable_additional_properties", "whitespace_pattern",
               "backend", "structural_tag")
COMPACT = {"whitespace_flexible": False}  # (llguidance's option: no white space between tokens)
FORMAT_TYPES = ("text", "json_object", "json_schema")


def parse_structured(body: dict) -> StructuredOutput | None:
    """The body's structured output (None: free text), checked and compiled; ApiError(400)
    naming the field at fault, or both fields where two constraints are given."""
    asked = [*_response_format(body.get("response_format")), *_vllm_fields(body),
             *_structured_outputs(body.get("structured_outputs")), *_llama_fields(body)]
    if len(asked) > 1:
        names = " and ".join(dict.fromkeys(name for name, _, _ in asked))
        raise ApiError(400, f"a request may hold its reply to one structured output; {names} "
                            "each give one: leave one out", asked[1][0])
    if not asked:
        return None
    name, kind, value = asked[0]
    try:
        return StructuredOutput(**{kind: value})
    except ConfigError as e:
        line = "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())[:400]
        raise ApiError(400, f"{name}: {line}", name) from None


def _response_format(fmt) -> list[tuple[str, str, object]]:
    """OpenAI's response_format as [(field, kind, value)] (none for text)."""
    if fmt is None:
        return []
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMAT_TYPES:
        raise ApiError(400, "response_format must be {\"type\": X} with X one of "
                            f"{', '.join(FORMAT_TYPES)}", "response_format")
    if kind == "text":
        return []
    if kind == "json_object":  # (llama.cpp's server takes a schema beside it)
        schema = fmt.get("schema")
        return [("response_format", "json", True if schema is None else schema)]
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object with the schema "
                            "({\"name\": ..., \"schema\": {...}})", "response_format.json_schema")
    for key, types, what in (("name", str, "a string"), ("description", str, "a string"),
                             ("strict", bool, "true or false")):
        if spec.get(key) is not None and not isinstance(spec[key], types):
            raise ApiError(400, f"response_format.json_schema.{key} must be {what}",
                           f"response_format.json_schema.{key}")
    schema = spec.get("schema")  # (none: any JSON object, as json_object gives)
    return [("response_format.json_schema.schema", "json", True if schema is None else schema)]


def _vllm_fields(body: dict) -> list[tuple[str, str, object]]:
    """vLLM's guided_* fields that the body sets (as [(field, kind, value)])."""
    out = []
    for kind in ("json", "regex", "choice", "grammar"):
        value = body.get(f"guided_{kind}")
        if value is not None:
            out.append((f"guided_{kind}", kind, _checked(f"guided_{kind}", kind, value)))
    return out


def _structured_outputs(spec) -> list[tuple[str, str, object]]:
    """vLLM's structured_outputs object as [(field, kind, value)]."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise ApiError(400, "structured_outputs must be an object (json, regex, choice, grammar "
                            "or json_object)", "structured_outputs")
    out = []
    compact = spec.get("disable_any_whitespace")
    if compact not in (None, True, False):
        name = "structured_outputs.disable_any_whitespace"
        raise ApiError(400, f"{name} must be true or false", name)
    for key, value in spec.items():
        name = f"structured_outputs.{key}"
        if key == "disable_any_whitespace" or key in OFF_OPTIONS and value in (None, False, ""):
            continue
        if key not in OUTPUT_KEYS:
            raise ApiError(400, f"{name} is not supported by this server; give one of "
                                f"{', '.join(OUTPUT_KEYS)}", name)
        if key == "json_object":
            if value not in (None, True, False):
                raise ApiError(400, f"{name} must be true or false", name)
            if value:
                out.append((name, "json", True))
        elif value is not None:
            out.append((name, key, _checked(name, key, value)))
    return [(name, kind, _compact(value) if compact and kind == "json" else value)
            for name, kind, value in out]


def _compact(schema: dict | str | bool) -> dict | str:
    """A JSON schema (True: any object) whose JSON has no white space between its tokens
    (vLLM's disable_any_whitespace), as llguidance's `x-guidance` options say."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return schema  # (StructuredOutput says what is wrong with it)
    if schema is True:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        return schema
    given = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(given if isinstance(given, dict) else {}), **COMPACT}}


def _llama_fields(body: dict) -> list[tuple[str, str, object]]:
    """llama.cpp's json_schema and grammar, where the body sets them."""
    out = []
    if body.get("json_schema") is not None:
        out.append(("json_schema", "json", _checked("json_schema", "json", body["json_schema"])))
    if body.get("grammar") is not None:
        out.append(("grammar", "grammar", _checked("grammar", "grammar", body["grammar"])))
    return out


def _checked(name: str, kind: str, value):
    """`value` if its JSON type suits `kind` (a list of choices as a tuple); ApiError(400)
    naming `name` else (StructuredOutput checks the rest)."""
    ok = {"json": (dict, str), "regex": (str,), "grammar": (str,), "choice": (list,)}[kind]
    if isinstance(value, bool) or not isinstance(value, ok):
        what = {"json": "a JSON schema (an object, or its JSON text)", "regex": "a string",
                "grammar": "a string (GBNF or Lark)", "choice": "an array of strings"}[kind]
        raise ApiError(400, f"{name} must be {what}", name)
    return tuple(value) if kind == "choice" else value


def gate_thinking(params: SamplingParams, opened: bool | None, tokenizer) -> SamplingParams:
    """`params` with its structured output starting after the reply's `</think>` where the
    reply starts inside a think block (`opened`: the reasoning parser's opens_thinking; None:
    no parser, the whole reply is held, as vLLM holds it without one). ApiError(400) where the
    tokenizer has no single `</think>` token to wait for."""
    if params.structured is None or not opened:
        return params
    ids = tokenizer.encode(CLOSE, add_special_tokens=False)
    if len(ids) != 1:
        raise ApiError(400, f"a structured output needs the model's {CLOSE} to be one token to "
                            "start after the thinking; turn thinking off (chat_template_kwargs "
                            '{"enable_thinking": false})', "chat_template_kwargs")
    structured = dataclasses.replace(params.structured, after_token=ids[0])
    return dataclasses.replace(params, structured=structured)


def check_with_tools(params: SamplingParams, tools) -> None:
    """ApiError(400) naming tool_choice where a request with a structured output forces a call
    (`tools`, an api_tools.ToolRequest or None: its reply is the call, held to the grammar of
    the function's schema, api_tool_grammar.py; a reply takes one grammar)."""
    if params.structured is not None and tools is not None and tools.forced:
        raise ApiError(400, 'tool_choice "required" or a named function cannot be combined with '
                            "a structured output (the reply is a call, held to the function's "
                            "schema); leave one out", "tool_choice")
