"""A line of OpenAI's batch format (vLLM's run-batch input) that is malformed is one error that
names the format's own fields and the line's custom_id: not a chat line's "messages must be a
non-empty array" with the format's fields listed as ignored, nor "id" for a bad custom_id. A
field of such a line outside its body is named on stderr as ignored (it was dropped without a
word), and a line's "model" that is not a string is its error, the server's 400."""

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


def test_a_field_outside_the_body_is_named_as_ignored():
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 0.5}
    jobs = parse({"custom_id": 1, "method": "POST", "url": URL, "body": body, "max_tokens": 3},
                 {"custom_id": 2, "url": URL, "body": body, "metadata": {}, "foo": 1})
    assert [(job.error, job.params.temperature) for job in jobs] == [(None, 0.5), (None, 0.5)]
    assert ignored_fields(jobs) == ('fields batch does not read were ignored: "foo" (line 2); '
                                    '"max_tokens" (line 1); "metadata" (line 2)')


def test_a_model_that_is_not_a_string_is_the_line_s_error():
    messages = [{"role": "user", "content": "x"}]
    jobs = parse({"messages": messages, "model": 5}, {"messages": messages, "model": "any"},
                 {"custom_id": "b", "url": URL, "body": {"messages": messages, "model": [1]}})
    says = "model must be a string (any name: the loaded model answers every line)"
    assert [job.error for job in jobs] == [says, None, says]
