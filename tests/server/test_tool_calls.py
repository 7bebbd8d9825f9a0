"""The qwen3_coder tool-call parser (statechat/api_tool_calls.py) on replies written by hand:
calls become OpenAI's tool calls with JSON arguments typed by the tool's schema, several calls,
values of many lines, missing closing tags, unknown functions (kept), text before, between and
after calls (content), malformed calls (their text stays content, nothing lost, nothing
raised), values nested too deep for json (their text) and values holding `<tool_call>`
(theirs); a stream cut anywhere gives the same content and calls as the whole reply."""

from __future__ import annotations

import itertools
import json

import pytest

from statechat.api_tool_calls import MAX_DEPTH, ToolCallStream, parse_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "hot": {"type": "boolean"}, "ratio": {"type": "number"},
            "where": {"type": "object"}, "tags": {"type": "array"},
            "maybe": {"type": ["string", "null"]}, "either": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}},
]


def call(name: str, **params: str) -> str:
    """A call as Qwen3.5 writes it."""
    parts = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{parts}</function>\n</tool_call>"


def args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_one_call_with_text_before_it():
    content, calls = parse_tool_calls("Let me look.\n\n" + call("get_weather", city="Paris"),
                                      TOOLS)
    assert content == "Let me look."
    assert args(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert isinstance(calls[0]["function"]["arguments"], str)


def test_a_reply_of_calls_alone_has_no_content_and_each_call_its_own_id():
    text = "\n\n" + call("get_weather", city="Oslo") + "\n" + call("shell", command="ls") + "\n"
    content, calls = parse_tool_calls(text, TOOLS)
    assert content is None
    assert args(calls) == [("get_weather", {"city": "Oslo"}), ("shell", {"command": "ls"})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("param, value, typed", [
    ("city", "42", "42"),  # (a string stays one, even when it reads as JSON)
    ("city", "null", "null"),
    ("days", "3", 3), ("days", "three", "three"),  # (not JSON: the string)
    ("hot", "true", True), ("hot", "False", False), ("hot", "maybe", "maybe"),
    ("ratio", "0.25", 0.25), ("ratio", "-1e3", -1000.0),
    ("where", '{"lat": 1.5, "names": ["a"]}', {"lat": 1.5, "names": ["a"]}),
    ("where", "{not json", "{not json"),
    ("tags", '["x", 2]', ["x", 2]),
    ("maybe", "7", "7"),  # (a string among its types: a string)
    ("either", "7", 7), ("either", "null", None),
    ("unknown", "5", "5"),  # (a parameter the schema does not know: a string)
    # (Python reads these, but they are not JSON: a strict client refused the arguments)
    ("ratio", "NaN", "NaN"), ("ratio", "-Infinity", "-Infinity"), ("ratio", "1e999", "1e999"),
    ("where", '{"lat": NaN}', '{"lat": NaN}'),
])
def test_values_are_typed_by_the_schema(param, value, typed):
    _, calls = parse_tool_calls(call("get_weather", **{param: value}), TOOLS)
    assert args(calls) == [("get_weather", {param: typed})]
    json.loads(calls[0]["function"]["arguments"], parse_constant=strict)  # (valid JSON)


def strict(name: str):
    raise AssertionError(f"{name} is not JSON")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 990, 5000])
def test_a_value_nested_past_max_depth_stays_the_string(depth):
    """A degenerate reply (a model repeating "[") nesting past what json's recursive reader or
    writer takes: the value stays its text, and nothing raises (a batch's other lines, a
    server's response, go on)."""
    deep = "[" * depth + "]" * depth
    reply = call("get_weather", tags=deep, days="3")
    _, calls = parse_tool_calls(reply, TOOLS)
    assert args(calls) == [("get_weather", {"tags": deep, "days": 3})]
    stream = ToolCallStream(TOOLS)  # (the server's stream ends its calls the same way)
    stream.feed(reply)
    stream.flush()
    assert stream.calls[0]["function"]["arguments"] == calls[0]["function"]["arguments"]


def test_a_value_nested_max_depth_deep_is_read():
    deep = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    _, calls = parse_tool_calls(call("get_weather", tags=deep), TOOLS)
    assert json.loads(calls[0]["function"]["arguments"])["tags"] == json.loads(deep)


def test_multi_line_values_keep_their_lines_and_inner_blank_lines():
    code = "def f():\n\n    return '<b>'\n"
    _, calls = parse_tool_calls(call("shell", command=code), TOOLS)
    assert args(calls) == [("shell", {"command": code})]


def test_an_unknown_function_is_kept_as_a_call_with_string_values():
    _, calls = parse_tool_calls(call("launch", count="3"), TOOLS)
    assert args(calls) == [("launch", {"count": "3"})]


def test_no_tools_at_all_still_parses():
    assert args(parse_tool_calls(call("f", x="1"), None)[1]) == [("f", {"x": "1"})]


@pytest.mark.parametrize("text, expected", [
    # no </parameter>: the value ends at the next parameter or at </function>
    ("<tool_call>\n<function=shell>\n<parameter=command>\nls\n<parameter=x>\n1\n</function>"
     + "\n</tool_call>", [("shell", {"command": "ls", "x": "1"})]),
    # no </function>
    ("<tool_call>\n<function=shell>\n<parameter=command>\nls\n</parameter>\n</tool_call>",
     [("shell", {"command": "ls"})]),
    # no </tool_call>, then the reply's end
    ("<tool_call>\n<function=shell>\n<parameter=command>\nls\n</parameter>\n</function>",
     [("shell", {"command": "ls"})]),
    # no </tool_call> before the next call
    ("<tool_call>\n<function=shell>\n<parameter=command>\na\n</parameter>\n</function>\n"
     + call("shell", command="b"), [("shell", {"command": "a"}), ("shell", {"command": "b"})]),
    # cut (max_tokens) inside a value: the value so far
    ("<tool_call>\n<function=shell>\n<parameter=command>\nrm -", [("shell", {"command": "rm -"})]),
    # cut inside a closing tag: the tag's start is not the value's, nor content
    ("<tool_call>\n<function=shell>\n<parameter=command>\nls\n</param",
     [("shell", {"command": "ls"})]),
    ("<tool_call>\n<function=shell>\n<parameter=command>\nls\n</parameter>\n</function>\n"
     + "</tool_c", [("shell", {"command": "ls"})]),
    # a name and nothing else
    ("<tool_call>\n<function=shell>", [("shell", {})]),
    # one line, no newlines at all
    ("<tool_call><function=get_weather><parameter=days>2</parameter></function></tool_call>",
     [("get_weather", {"days": 2})]),
])
def test_missing_closing_tags(text, expected):
    content, calls = parse_tool_calls(text, TOOLS)
    assert args(calls) == expected and content is None


@pytest.mark.parametrize("value", [
    "Write <tool_call> to call a tool.",
    "<tool_call>\n<function=shell>\n",  # (a call's opening, quoted)
])
def test_a_tool_call_tag_inside_a_value_is_the_value_s(value):
    """(It ended the call: the value was cut at the tag and the rest read as another call,
    or as content.)"""
    text = call("shell", command=value) + "\n" + call("get_weather", city="Oslo")
    content, calls = parse_tool_calls(text, TOOLS)
    assert args(calls) == [("shell", {"command": value}), ("get_weather", {"city": "Oslo"})]
    assert content is None


def test_text_between_and_after_calls_is_content():
    text = ("Checking.\n\n" + call("shell", command="a") + "\n\nThen this.\n"
            + call("shell", command="b") + "\n\nDone.\n")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Checking.\n\nThen this.\n\nDone."
    assert len(calls) == 2


def test_text_after_function_inside_a_call_is_content():
    text = ("<tool_call>\n<function=shell>\n<parameter=command>\nls\n</parameter>\n</function>\n"
            "oops\n</tool_call>")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "\noops" and args(calls) == [("shell", {"command": "ls"})]


@pytest.mark.parametrize("text", [
    "I would write <tool_call> here.",
    'Use the tag:\n<tool_call>\n{"name": "shell"}\n</tool_call>',  # (JSON: not this format)
    "<tool_call>\n<function=>\n</function>\n</tool_call>",  # (no name)
    "<tool_call>\n<function=a\nb>\n</function></tool_call>",  # (a name across lines)
    "<tool_call>\n<function=" + "x" * 300 + ">",  # (past MAX_NAME)
    "Answer.\n\n<tool_call>\n<funct",  # (cut before the name)
    "<tool_call>\n<function=get_wea",  # (cut inside the name)
    "<tool_call>",
    "plain text\n\n",
    "",
])
def test_malformed_calls_stay_content_whole(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert calls == [] and content == (text or None)


def test_a_malformed_call_then_a_good_one():
    text = "a <tool_call> b\n" + call("shell", command="ls")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "a <tool_call> b" and args(calls) == [("shell", {"command": "ls"})]


def test_a_stream_gives_the_name_first_then_the_arguments_whole():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("Hi.\n\n<tool_call>\n<function=sh") == ("Hi.", [])
    content, deltas = stream.feed("ell>\n<parameter=command>\nls\n")
    assert content == "" and len(deltas) == 1
    header = deltas[0]
    assert header["index"] == 0 and header["type"] == "function"
    assert header["function"] == {"name": "shell", "arguments": ""}
    assert header["id"].startswith("call_")
    content, deltas = stream.feed("</parameter>\n</function>\n</tool_call>")
    assert deltas == [{"index": 0, "function": {"arguments": '{"command": "ls"}'}}]
    assert stream.flush() == ("", [])
    assert stream.calls == [{"id": header["id"], "type": "function",
                             "function": {"name": "shell", "arguments": '{"command": "ls"}'}}]


SAMPLES = [
    "Let me look.\n\n" + call("get_weather", city="Paris", days="2") + "\n"
    + call("shell", command="echo '<b>'\n\nx") + "\nDone.",
    "a <tool_call> b\n" + call("shell", command="ls") + "\n<tool_call>\n<function=f",
    "text <tool_c then </tool_call> and <function=x> alone\n\n",
    "<tool_call>\n<function=shell>\n<parameter=command>\nls\n</function>\nafter\n",
    call("shell", command="say <tool_call>\n<function=x> here") + "\n" + call("f"),
]


@pytest.mark.parametrize("text", SAMPLES)
def test_a_stream_cut_anywhere_gives_the_whole_replys_result(text):
    whole_content, whole_calls = parse_tool_calls(text, TOOLS)
    strip = [{**c, "id": None} for c in whole_calls]
    for cuts in itertools.chain.from_iterable(
            itertools.combinations(range(1, len(text)), k) for k in (1, 2)):
        if len(cuts) == 2 and cuts[0] % 3:  # (every single cut, and a third of the pairs)
            continue
        bounds = (0, *cuts, len(text))
        stream, content, calls = ToolCallStream(TOOLS), "", {}
        for piece in [*(text[a:b] for a, b in itertools.pairwise(bounds)), None]:
            got, deltas = stream.feed(piece) if piece is not None else stream.flush()
            content += got
            for d in deltas:
                made = calls.setdefault(d["index"], {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                made["function"]["name"] += d["function"].get("name", "")
                made["function"]["arguments"] += d["function"]["arguments"]
        assert (content or None, list(calls.values())) == (whole_content, strip), cuts
