"""Structured outputs on Anthropic's Messages API (`output_config.format`, the body that
Anthropic's SDK sends for `messages.parse(output_format=Model)`, and the beta's top-level
`output_format`), on the embedded tiny model: the reply's text is JSON that the schema
describes, whole and streamed, rather than a free reply as if the field had not been sent; a
schema that does not compile, a format of another type or an unknown `output_config` key is
a 400 in Anthropic's shape naming Anthropic's field."""

from __future__ import annotations

import json

import pytest

from tests.server.test_anthropic import call, text_of

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["ok", "kind"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # (a random model writes no padding)
ASK = {"model": "claude-any", "max_tokens": 60, "temperature": 0,
       "messages": [{"role": "user", "content": "JSON, please."}]}
FORMAT = {"type": "json_schema", "schema": SCHEMA}


@pytest.mark.parametrize("fields", [{"output_config": {"format": FORMAT, "effort": "low"}},
                                    {"output_format": FORMAT}])
def test_the_reply_is_held_to_the_schema(server, fields):
    status, reply = call(server, {**ASK, **fields})
    assert status == 200 and reply["stop_reason"] == "end_turn", reply
    answer = json.loads(text_of(reply))
    assert set(answer) == {"ok", "kind"} and answer["kind"] in ("a", "b")
    status, events = call(server, {**ASK, **fields, "stream": True})
    streamed = "".join(data["delta"].get("text", "") for name, data in events
                       if name == "content_block_delta")
    assert status == 200 and streamed == text_of(reply)


@pytest.mark.parametrize(("fields", "param"), [
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
     "output_config.format.schema"),
    # (the beta's field, where it was sent: the error named output_config.format.schema)
    ({"output_format": {"type": "json_schema", "schema": {"type": "nope"}}},
     "output_format.schema"),
    ({"output_config": {"format": {"type": "yaml"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"verbosity": "low"}}, "output_config.verbosity"),
    ({"output_config": "json"}, "output_config"),
    ({"output_format": FORMAT, "output_config": {"format": FORMAT}}, "output_format"),
])
def test_a_bad_format_is_a_400_naming_the_field(server, fields, param):
    status, answer = call(server, {**ASK, **fields})
    assert status == 400 and answer["type"] == "error", answer
    message = answer["error"]["message"]
    assert message.startswith(param) and "\n" not in message, message
    assert answer["error"]["type"] == "invalid_request_error"
