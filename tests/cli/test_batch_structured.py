"""`statechat batch` takes a line's structured output as the server takes a body's (the same
parsing: response_format, vLLM's guided_* and structured_outputs, llama.cpp's json_schema and
grammar), in plain chat lines and OpenAI batch-format lines: each result's text is the schema's
JSON, a match of the regex, one of the choices (every sample of n); two constraints or a bad one
are the line's error, with the server's message, and the other lines still run; with
--reasoning-parser, a thinking template's reply is held after its `</think>` (its answer),
while a line with thinking off is held from its first token."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from statechat import cli, cli_setup
from statechat.paths import EMBEDDED_MODEL

SCHEMA = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}},
          "required": ["size"], "additionalProperties": False}
ASK = {"messages": [{"role": "user", "content": "Size?"}], "max_tokens": 30}
URL = "/v1/chat/completions"


def run(tmp_path, lines: list[dict], *flags: str) -> list[dict]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--model",
                                          str(EMBEDDED_MODEL), "--device", "cpu", "--no-cache",
                                          *flags])
    assert result.exit_code == 0, result.output
    assert "ignored" not in result.stderr  # (every field was read)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_each_line_s_structured_output_holds(tmp_path, shared_engine):
    compact = {"disable_any_whitespace": True}
    results = run(tmp_path, [
        {"id": "schema", **ASK, "structured_outputs": {"json": SCHEMA, **compact}},
        {"custom_id": "fmt", "method": "POST", "url": URL, "body": {
            **ASK, "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "schema": {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}}}}},
        {"id": "regex", **ASK, "guided_regex": "[xy]{4}"},
        {"id": "choice", **ASK, "guided_choice": ["left", "right"], "n": 2, "temperature": 1},
        {"id": "gbnf", **ASK, "grammar": 'root ::= "a" [0-9]'},
        {"id": "two", **ASK, "guided_regex": "a", "json_schema": SCHEMA},
        {"id": "bad", **ASK, "guided_regex": "(a"},
    ])
    schema, fmt, regex, choice, gbnf, two, bad = results
    assert json.loads(schema["text"])["size"] in "SML" and json.loads(fmt["text"])["size"] in "SML"
    assert re.fullmatch("[xy]{4}", regex["text"]) and re.fullmatch("a[0-9]", gbnf["text"])
    assert [c["text"] in ("left", "right") for c in choice["choices"]] == [True, True]
    assert two["error"]["message"].startswith("a request may hold its reply to one structured "
                                              "output; guided_regex and json_schema")
    assert bad["error"]["message"].startswith("guided_regex: the regex of the structured output")


def test_a_thinking_reply_is_held_after_its_thinking(tmp_path, loaded, monkeypatch):
    from statechat.engine.engine import LLMEngine
    from tests.helpers import THINKING, with_template

    monkeypatch.setattr(cli_setup, "load_engine", lambda config: LLMEngine(
        config, loaded=with_template(loaded, THINKING)))
    end = loaded.tokenizer.convert_tokens_to_ids("</think>")
    line = {**ASK, "guided_choice": ["yes", "no"], "logit_bias": {str(end): 100},
            "skip_special_tokens": False}  # (the tiny model pushed to end its thinking first)
    think, off = run(tmp_path, [line, {**line, "chat_template_kwargs": {"enable_thinking": False}}],
                     "--reasoning-parser", "qwen3")
    assert think["text"] in ("yes", "no") and not think["reasoning"]
    assert off["text"] in ("yes", "no")
