"""A line of OpenAI's batch format (vLLM's run-batch input) that is malformed is one error that
names the format's own fields and the line's custom_id: not a chat line's "messages must be a
non-empty array" with the format's fields listed as ignored, nor "id" for a bad custom_id."""

from __future__ import annotations

import json

from statechat.batch_lines import BatchDefaults, ignored_fields, parse_lines

URL = "/v1/chat/completions"


def parse(*lines: dict):
    return parse_lines([json.dumps(line) for line in lines], BatchDefaults())


def test_a_body_that_is_not_an_object_is_named_with_the_line_s_custom_id():
    [job] = parse({"custom_id": "req-3", "method": "POST", "url": URL, "body": "hi"})
    assert job.id == "req-3"
    assert job.error == 'line 1: "body" must be a JSON object (the chat request), got "hi"'
    assert ignored_fields([job]) is None


def test_a_custom_id_that_is_not_a_string_or_number_is_named_as_such():
    [job] = parse({"custom_id": {"a": 1}, "url": URL,
                   "body": {"messages": [{"role": "user", "content": "x"}]}})
    assert job.error == 'line 1: "custom_id" must be a string or a number, got {"a": 1}'


def test_a_line_of_the_format_still_runs_its_body():
    [job] = parse({"custom_id": 7, "method": "POST", "url": URL,
                   "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}})
    assert (job.id, job.error, job.params.max_tokens) == (7, None, 3)
