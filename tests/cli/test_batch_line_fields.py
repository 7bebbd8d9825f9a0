"""A batch line's fields are told as they were read: a completions line's "prompt", which is
the line's error, is not also named as ignored on stderr; and "n" is taken as the server takes
it (1.0 is 1; true is not a count, and is the line's error, not one sample; 1 to 16); vLLM's
include_stop_str_in_output and skip_special_tokens are read, a value that is not true or
false the line's error; and a byte-order
mark starting any line of the input is read past, as the first line's is; a bad value is
shown in JSON's form, as the line wrote it."""

from __future__ import annotations

import json

import pytest

from statechat.batch_lines import BatchDefaults, ignored_fields, parse_lines

MESSAGES = [{"role": "user", "content": "hi"}]


def parse(*lines: dict):
    return parse_lines([json.dumps(line) for line in lines], BatchDefaults())


def test_a_completions_line_s_prompt_is_its_error_not_an_ignored_field():
    jobs = parse({"id": "c", "prompt": "Once upon a time", "foo": 1},
                 {"id": "m", "messages": MESSAGES, "prompt": "left out"})
    assert "give \"messages\", not \"prompt\"" in jobs[0].error
    assert jobs[1].error is None
    # (line 1's prompt was named as ignored, beside its error saying it was the wrong form)
    assert ignored_fields(jobs) == ('fields batch does not read were ignored: "foo" (line 1); '
                                    '"prompt" (line 2)')


@pytest.mark.parametrize("n, error", [(1, None), (1.0, None), (None, None), (3, None),
                                      (True, "n must be an integer from 1 to 16, got true"),
                                      (17, "n must be an integer from 1 to 16, got 17"),
                                      (0, "n must be an integer"), ("1", "n must be an integer")])
def test_n_is_read_as_the_server_reads_it(n, error):
    [job] = parse({"messages": MESSAGES, "n": n})
    if error is None:
        assert job.error is None and job.params.max_tokens == 256
        assert job.params.n == (n or 1)
    else:
        assert job.error.startswith(error)


def test_kept_stops_and_special_tokens_are_read():
    keep, plain, bad = parse(
        {"messages": MESSAGES, "include_stop_str_in_output": True, "skip_special_tokens": False},
        {"messages": MESSAGES}, {"messages": MESSAGES, "skip_special_tokens": "no"})
    assert keep.params.include_stop_str_in_output and not keep.params.skip_special_tokens
    assert not plain.params.include_stop_str_in_output and plain.params.skip_special_tokens
    assert bad.error == 'skip_special_tokens must be true or false, got "no"'
    assert ignored_fields([keep, plain, bad]) is None


def test_a_byte_order_mark_starting_any_line_is_read_past(tmp_path):
    """Two files saved with a byte-order mark and joined with `cat` run both: the second file's
    first line was `not valid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig))`."""
    from statechat.cli_batch import read_requests

    one = "\ufeff" + json.dumps({"id": "a", "messages": MESSAGES}) + "\r\n"
    src = tmp_path / "joined.jsonl"
    src.write_bytes((one + one.replace('"a"', '"b"')).encode())
    jobs = parse_lines(read_requests(src), BatchDefaults())
    assert [(job.id, job.error) for job in jobs] == [("a", None), ("b", None)]


@pytest.mark.parametrize("fields, says", [
    ({"max_tokens": True}, "max_tokens must be an integer, got true"),
    ({"temperature": "hot"}, 'temperature must be a number, got "hot"'),
    ({"top_k": [1, None]}, "top_k must be an integer, got [1, null]"),
    ({"stop": ["", "end"]},
     'stop must be a string or a list of non-empty strings, got ["", "end"]'),
    ({"logit_bias": {"a": 1}}, 'logit_bias keys must be token ids (integers >= 0), got "a"'),
    ({"min_p": {"é": None}}, 'min_p must be a number, got {"é": null}'),
])
def test_a_bad_value_is_shown_as_the_line_wrote_it(fields, says):
    """A line's bad value is shown in JSON's form, as the line gave it (it was Python's:
    `got True`, `got 'hot'`, `got {'é': None}`)."""
    [job] = parse({"messages": MESSAGES, **fields})
    assert job.error == says
