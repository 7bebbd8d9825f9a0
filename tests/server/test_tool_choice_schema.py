"""A call forced by tool_choice (a named function, or "required") under `serve
--tool-call-parser qwen3_coder` is held to the function's `parameters` schema, as vLLM's
structured outputs hold it: the tiny random model, which writes garbage when free, makes calls
whose arguments the schema accepts (required parameters there, values of their types, enums,
bounds and lengths held, no parameter the schema lacks), whole or streamed, for every choice;
"required" calls only the tools, by name, and writes nothing after its calls (one call alone
with parallel_tool_calls false). A schema the
grammar cannot hold leaves the call unheld, as before, and says so in the log; min_tokens with
a held call is a 400 naming it."""

from __future__ import annotations

import json
import logging

import pytest

from tests.server.test_tools_server import reassembled, whole, without_ids
from tests.serving import TOOLS_ASK as ASK
from tests.serving import post, tools_fixtures

PLAN = {"type": "function", "function": {"name": "plan", "parameters": {
    "type": "object", "properties": {
        "mode": {"type": "string", "enum": ["fast", "slow"]},
        "steps": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
        "note": {"type": "string", "maxLength": 3},
        "dry": {"type": "boolean"}},
    "required": ["mode", "steps", "note"],
    "$defs": {"tag": {"type": "string", "enum": ["red", "blue"]}}}}}
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"which": {"const": "left"}}, "required": ["which"]}}}
PING = {"type": "function", "function": {"name": "ping"}}  # (no parameters: called with none)
TOOLS = [PLAN, PICK, PING]
NAMED = {"type": "function", "function": {"name": "plan"}}
# (random choices; the most the tiny model's context leaves after these tools)
SAMPLED = {"temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 250}


loaded, server = tools_fixtures()


def valid(value, schema: dict, defs: dict) -> bool:
    """Whether `value` is valid against `schema` (the keywords these tests' schemas use)."""
    if "$ref" in schema:
        return valid(value, defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    kinds = {"string": str, "integer": int, "boolean": bool, "array": list, "object": dict}
    if "type" in schema and (not isinstance(value, kinds[schema["type"]]) or (
            schema["type"] == "integer" and isinstance(value, bool))):
        return False
    if ("enum" in schema and value not in schema["enum"]) or (
            "const" in schema and value != schema["const"]):
        return False
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return False
    if isinstance(value, int) and not schema.get("minimum", value) <= value \
            <= schema.get("maximum", value):
        return False
    if isinstance(value, list):
        return len(value) <= schema.get("maxItems", len(value)) and all(
            valid(item, schema.get("items", {}), defs) for item in value)
    return True


def assert_valid_call(call: dict) -> None:
    """The call names one of TOOLS and its arguments are valid against its schema."""
    (tool,) = [t for t in TOOLS if t["function"]["name"] == call["function"]["name"]]
    schema = tool["function"].get("parameters", {"properties": {}})
    arguments = json.loads(call["function"]["arguments"])
    assert set(schema.get("required", ())) <= set(arguments) <= set(schema["properties"]), \
        arguments
    for name, value in arguments.items():
        assert valid(value, schema["properties"][name], schema.get("$defs", {})), (name, value)


def test_a_named_function_s_call_holds_to_its_schema(server):
    body = {**ASK, "tools": TOOLS, "tool_choice": NAMED, **SAMPLED, "n": 2}
    answer = post(server, body)
    chunks = post(server, {**body, "stream": True})
    for k, choice in enumerate(answer["choices"]):
        got = whole(choice)
        assert (got["content"], got["finish_reason"]) == (None, "stop"), got
        (made,) = got["tool_calls"]
        assert made["function"]["name"] == "plan"
        assert_valid_call(made)
        assert without_ids(reassembled(chunks, k)) == without_ids(got)


def test_required_calls_only_the_tools_and_holds_each_to_its_schema(server):
    """(A random model may go on calling until max_tokens: its last call may then be cut.)"""
    body = {**ASK, "tools": TOOLS, "tool_choice": "required", **SAMPLED, "seed": 3}
    answer = post(server, body)
    chunks = post(server, {**body, "stream": True})
    ends = []
    for k, choice in enumerate(answer["choices"]):
        got = whole(choice)
        ends.append(got["finish_reason"])
        assert got["tool_calls"] and got["finish_reason"] in ("tool_calls", "length"), got
        whole_calls = got["tool_calls"][:-1 if got["finish_reason"] == "length" else None]
        for made in whole_calls:
            assert_valid_call(made)
        assert got["content"] is None or got["finish_reason"] == "length"
        assert without_ids(reassembled(chunks, k)) == without_ids(got)
    assert "tool_calls" in ends


def test_a_schema_the_grammar_cannot_hold_leaves_the_call_as_before(server, caplog):
    """(A $ref to nothing: llguidance refuses it; the call is made unheld, as before.)"""
    broken = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"x": {"type": "object", "$ref": "#/nowhere"}},
        "required": ["x"]}}}
    with caplog.at_level(logging.WARNING, logger="statechat.server"):
        answer = post(server, {**ASK, "tools": [broken], "max_tokens": 8, "tool_choice": {
            "type": "function", "function": {"name": "broken"}}})
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "broken"
    (said,) = [r.getMessage() for r in caplog.records if "without holding" in r.getMessage()]
    assert "function 'broken'" in said and "\n" not in said


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_min_tokens_with_a_held_call_is_a_400_naming_it(server, choice):
    answer = post(server, {**ASK, "tools": TOOLS, "tool_choice": choice, "min_tokens": 2})
    assert answer["status"] == 400 and answer["error"]["param"] == "min_tokens"
    assert "the call's grammar decides where the reply ends" in answer["error"]["message"]


def test_required_with_parallel_calls_off_makes_one_call(server):
    """parallel_tool_calls false: "required" is held to exactly one call (its grammar ends
    after it), which the reply ends with."""
    body = {**ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            **SAMPLED, "seed": 3}
    answer = post(server, body)
    chunks = post(server, {**body, "stream": True})
    for k, choice in enumerate(answer["choices"]):
        got = whole(choice)
        assert len(got["tool_calls"]) == 1, got
        if got["finish_reason"] != "length":
            assert (got["content"], got["finish_reason"]) == (None, "tool_calls"), got
            assert_valid_call(got["tool_calls"][0])
        assert without_ids(reassembled(chunks, k)) == without_ids(got)


@pytest.mark.parametrize("is_parallel, takes_two", [(True, True), (False, False)])
def test_required_s_grammar_takes_a_second_call_only_with_parallel_calls(loaded, is_parallel,
                                                                       takes_two):
    import llguidance
    import llguidance.hf

    from statechat.api_tool_grammar import call_grammar

    held = call_grammar(TOOLS, None, loaded.tokenizer, is_parallel=is_parallel)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(loaded.tokenizer), held.spec,
                                   log_level=0)
    one = "<function=ping>\n</function>\n</tool_call>"
    ids = loaded.tokenizer.encode(one + "\n<tool_call>\n" + one, add_special_tokens=False)
    first = len(loaded.tokenizer.encode(one, add_special_tokens=False))
    assert matcher.consume_tokens(ids[:first]) and matcher.is_accepting()
    assert bool(matcher.consume_tokens(ids[first:])) is takes_two


def test_a_name_required_twice_is_written_once():
    """(A name listed twice in `required`, and not in `properties`, was written twice.)"""
    from statechat.api_tool_grammar import grammar_text

    function = {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["b", "b", "a"]}}
    text = grammar_text([{"type": "function", "function": function}], "f",
                        {"<tool_call>": '"<tool_call>"', "</tool_call>": '"</tool_call>"'})
    assert text.count('"<parameter=b>\\n"') == 1 and text.count('"<parameter=a>\\n"') == 1
