"""A batch line that is not JSON says where it breaks and, for a line of plain text (a file of
prompts, as llama.cpp's `-f` or vLLM's `LLM.generate` take them), what a line must be: every
such line said only `not valid JSON (Expecting value)`."""

from __future__ import annotations

from statechat.batch_lines import BatchDefaults, parse_lines


def errors(*lines: str) -> list[str]:
    return [job.error for job in parse_lines(list(lines), BatchDefaults())]


def test_a_plain_text_line_says_what_a_line_must_be():
    [error] = errors("Tell me about prefix caches.")
    assert error.startswith("line 1 is not valid JSON")
    assert '{"messages": [{"role": "user", "content": ' in error  # the form it takes


def test_broken_json_names_the_column():
    [ok, error] = errors('{"messages": [{"role": "user", "content": "hi"}]}',
                         '{"messages": [{"role": "user", "content": "hi"}] "max_tokens": 4}')
    assert ok is None
    assert error == "line 2 is not valid JSON (Expecting ',' delimiter at column 50)"
