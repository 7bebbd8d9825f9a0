"""Structured outputs through the server, with the embedded tiny model (whose free replies are
noise): OpenAI's response_format (json_schema, json_object), vLLM's guided_json, guided_regex,
guided_choice, guided_grammar and structured_outputs, and llama.cpp's json_schema and grammar
each give a reply that parses as the schema's JSON, matches the regex, is one of the choices or
is a sentence of the grammar, in both APIs; a stream gives the same text as the whole reply;
each of n=2 choices holds; two constraints, a bad schema, regex or grammar, a field of the
wrong type and a forced tool call with one are 400s naming the field, in one line."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import torch

from tests import serving as served

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # (a random model writes no padding)
ASK = {"model": "m", "messages": [{"role": "user", "content": "Pick."}], "max_tokens": 40}


@pytest.fixture(scope="module")
def server():
    from statechat.model.loader import load_model
    from statechat.paths import EMBEDDED_MODEL

    loaded = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    with served.serving(loaded, tool_call_parser=None) as srv:
        yield srv


def complete(server, body: dict) -> dict:
    """POST /v1/completions' JSON answer."""
    req = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {served.KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def chat(server, **fields) -> dict:
    return served.post(server, {**ASK, **fields})


def content(server, **fields) -> str:
    reply = chat(server, **fields)
    assert "error" not in reply, reply
    assert reply["choices"][0]["finish_reason"] == "stop"  # (the constraint ended it)
    return reply["choices"][0]["message"]["content"]


def valid(text: str) -> bool:
    """Whether `text` is SCHEMA's JSON."""
    value = json.loads(text)
    return set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue") \
        and isinstance(value["ok"], bool)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA,
                                                                "strict": True}}},
    {"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA},
    {"structured_outputs": {"json": {**SCHEMA, "x-guidance": {}},
                            "disable_any_whitespace": True}},
], ids=["response_format", "guided_json", "guided_json_text", "llama_json_schema",
        "structured_outputs"])
def test_a_json_schema_gives_json_of_it(server, fields):
    assert valid(content(server, **fields))


def test_json_object_gives_a_json_object(server):
    for fields in ({"response_format": {"type": "json_object"}},
                   {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}):
        assert isinstance(json.loads(content(server, seed=3, **fields)), dict)


@pytest.mark.parametrize("fields, check", [
    ({"guided_regex": "[ab]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[ab]{3}-[0-9]{2}", t)),
    ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'root ::= "x" ("y" | "z") "!"'}, lambda t: t in ("xy!", "xz!")),
    ({"grammar": 'root ::= [0-9] [0-9]'}, lambda t: re.fullmatch("[0-9]{2}", t)),
    ({"structured_outputs": {"grammar": 'start: "a" ("b" | "c")'}}, lambda t: t in ("ab", "ac")),
])
def test_regex_choice_and_grammar_hold(server, fields, check):
    for seed in (1, 2):
        assert check(content(server, seed=seed, temperature=1.0, **fields))


def test_a_stream_gives_the_whole_reply_s_text(server):
    fields = {"guided_json": SCHEMA, "temperature": 0}
    whole = content(server, **fields)
    chunks = chat(server, stream=True, **fields)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c.get("choices"))
    assert streamed == whole and valid(streamed)


def test_each_of_n_choices_holds(server):
    reply = chat(server, n=2, seed=7, temperature=1.0, guided_json=SCHEMA)
    assert [valid(c["message"]["content"]) for c in reply["choices"]] == [True, True]


def test_text_completions_take_them_too(server):
    body = {"model": "m", "prompt": ["Once", "Twice"], "max_tokens": 40, "n": 2, "seed": 3,
            "guided_choice": ["one", "two"]}
    reply = complete(server, body)
    assert [c["text"] in ("one", "two") for c in reply["choices"]] == [True] * 4
    body = {"model": "m", "prompt": "Once", "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}
    assert valid(complete(server, body)["choices"][0]["text"])


@pytest.mark.parametrize("fields, param, says", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex",
     "guided_json and guided_regex each give one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
     "structured_outputs.choice", "response_format and structured_outputs.choice each give one"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs.regex",
     "structured_outputs.json and structured_outputs.regex each give one"),
    ({"guided_regex": "[a-"}, "guided_regex", "guided_regex: the regex of the"),
    ({"guided_json": {"type": "nothing"}}, "guided_json", "guided_json: the json of the"),
    ({"guided_json": "{not json"}, "guided_json", "is not JSON"),
    ({"grammar": "root ::= ("}, "grammar", "grammar: "),
    ({"guided_grammar": "start: (x"}, "guided_grammar", "guided_grammar: the grammar of"),
    ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be an array of strings"),
    ({"guided_choice": []}, "guided_choice", "choice must be a list of non-empty strings"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "response_format.json_schema must be an object"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     "structured_outputs.structural_tag is not supported"),
    ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens", "min_tokens cannot be used"),
])
def test_bad_requests_are_400s_naming_the_field(server, fields, param, says):
    reply = chat(server, **fields)
    assert reply["status"] == 400 and reply["error"]["param"] == param, reply
    assert says in reply["error"]["message"] and "\n" not in reply["error"]["message"]


def test_text_format_and_nulls_are_free_text(server):
    reply = chat(server, response_format={"type": "text"}, guided_json=None, grammar=None,
                 structured_outputs={"json_object": False}, max_tokens=3, ignore_eos=True)
    assert reply["choices"][0]["finish_reason"] == "length"


def test_a_forced_tool_call_with_a_structured_output_is_a_400(tmp_path):
    loaded = served.tools_model(tmp_path / "tiny-tools")
    with served.serving(loaded) as srv:
        reply = served.post(srv, {**served.TOOLS_ASK, "tool_choice": "required",
                                  "guided_choice": ["a"]})
        assert (reply["status"], reply["error"]["param"]) == (400, "tool_choice")
        reply = served.post(srv, {**served.TOOLS_ASK, "guided_choice": ["a"], "max_tokens": 9})
        assert reply["choices"][0]["message"]["content"] == "a"  # ("auto": the text is held)


def test_a_grammar_naming_a_token_the_model_lacks_is_a_400(server):
    """(It was a 200 with an empty reply: the matcher failed at its first step.)"""
    reply = chat(server, guided_grammar='start: <|not_a_token|> "x"')
    assert reply["status"] == 400, reply
    assert "unknown special token" in reply["error"]["message"]
