"""`statechat batch --tool-call-parser qwen3_coder`, on the tiny checkpoint whose template
renders tools (tests/helpers.py's TOOLS_TEMPLATE), with replies forced to hold a call: each
line's result has the text, reasoning, tool calls, finish_reason and token counts of the
server's whole response to the same body (with and without `--reasoning-parser qwen3`), as do
lines whose tool_choice forces a call ("required", a named function: the call's opening in the
prompt, as the server's; a named function's reply ends with its one call, as the server's); a
line with bad tools, a bad tool_choice, a bad tool message or min_tokens with a forced call
(held to its schema, as the server's) has the server's 400 message as its error while the
others run; without the flag, tools are a line
error that names it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from statechat import cli, cli_setup
from statechat.engine.engine import LLMEngine
from tests.helpers import force_reply
from tests.serving import CALL, REPLY, post, serving, tools_model
from tests.serving import TOOLS_ASK as ASK
from tests.serving import TOOLS_HISTORY as HISTORY

BODIES = [  # (each runs as a batch line and as a request to the server)
    ASK,
    {**ASK, "messages": HISTORY},  # (the calls made and the tool's answer rendered)
    {**ASK, "tool_choice": "none"},  # (the tools rendered, the reply not parsed)
    {k: v for k, v in ASK.items() if k != "tools"},  # (no tools: the text whole)
]  # (and one cut inside the call's last value: "length", the call so far)
THOUGHT = "The user wants weather.</think>\n\n"
BAD_BODIES = [  # (the server's 400s; the batch line's errors)
    {**ASK, "tools": {"type": "function"}},
    {**ASK, "tools": [{"type": "function", "function": {"name": ""}}]},
    {**ASK, "tools": [], "tool_choice": "required"},
    {**ASK, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    {**ASK, "tools": [{"type": "function", "function": {"name": "a<b"}}]},
    {**ASK, "messages": [*HISTORY[:2], {"role": "tool", "content": "Sunny"}]},
    {**ASK, "messages": [*HISTORY[:1], {**HISTORY[1], "tool_calls": [{"id": "c"}]}]},
    {**ASK, "messages": [*HISTORY[:1], {**HISTORY[1], "tool_calls": [{  # (json's reader raised)
        "id": "c", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]},
    {**ASK, "tool_choice": "required", "min_tokens": 2},  # (the call is held to its schema)
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tools_model(tmp_path_factory.mktemp("tools") / "tiny-tools")


def run_batch(tmp_path, monkeypatch, loaded, lines: list[dict], *flags: str,
              reply: str = REPLY, env: dict | None = None):
    """(result, records) of `batch` over `lines` (OpenAI's batch format where a line has
    "custom_id") on `loaded`, every reply forced to `reply`."""
    def load_engine(config):
        engine = LLMEngine(config, loaded=loaded)
        force_reply(engine, monkeypatch, reply)
        return engine

    monkeypatch.setattr(cli_setup, "load_engine", load_engine)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(cli.app, ["batch", str(src), "-o", str(out), "--device", "cpu",
                                          "--no-cache", *flags], env=env)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return result, records


def without_ids(calls: list[dict] | None) -> list[dict] | None:
    assert all(c["id"].startswith("call_") for c in calls or ())
    return None if calls is None else [{**c, "id": None} for c in calls]


@pytest.mark.parametrize("reasoning", [False, True])
def test_each_result_is_the_server_s_whole_response(tmp_path, monkeypatch, loaded, reasoning):
    """The lines, in OpenAI's batch format (vLLM's run-batch reads it), give what the server
    answers: the calls parsed from the answer (after the reasoning, with its parser), the text
    outside them, finish_reason "tool_calls" by the server's rule, the same prompt tokens."""
    flags = ["--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice"]
    fields, reply = {}, REPLY
    if reasoning:
        flags += ["--reasoning-parser", "qwen3"]
        fields, reply = {"reasoning_parser": "qwen3"}, THOUGHT + REPLY
    with serving(loaded, **fields) as srv:
        forced = force_reply(srv.worker.engine, monkeypatch, reply)
        bodies = [{**body, "chat_template_kwargs": {}} if reasoning else body
                  for body in [*BODIES, {**ASK, "max_tokens": len(forced) - 30}]]
        answers = [post(srv, body) for body in bodies]
    lines = [{"custom_id": f"req-{n}", "method": "POST", "url": "/v1/chat/completions",
              "body": body} for n, body in enumerate(bodies)]
    result, records = run_batch(tmp_path, monkeypatch, loaded, lines, *flags, reply=reply)
    assert result.exit_code == 0, result.output
    assert "ignored" not in result.stderr  # (tools and tool_choice are read)
    for record, answer in zip(records, answers, strict=True):
        choice = answer["choices"][0]
        message = choice["message"]
        assert record["text"] == (message["content"] or "")
        assert record.get("reasoning") == message.get("reasoning")
        assert without_ids(record.get("tool_calls")) == without_ids(message.get("tool_calls"))
        assert record["finish_reason"] == choice["finish_reason"]
        assert record["usage"]["prompt_tokens"] == answer["usage"]["prompt_tokens"]
        assert record["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
    called, history, unparsed, plain, cut = records
    assert called["finish_reason"] == history["finish_reason"] == "tool_calls"
    assert json.loads(called["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris",
                                                                             "days": 3}
    assert history["usage"]["prompt_tokens"] > called["usage"]["prompt_tokens"]
    assert CALL in unparsed["text"] and "tool_calls" not in unparsed
    assert plain["usage"]["prompt_tokens"] < called["usage"]["prompt_tokens"]  # (no tools)
    assert cut["finish_reason"] == "length"
    assert json.loads(cut["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris",
                                                                          "days": 3}
    assert (called.get("reasoning"), called["text"]) == (
        ("The user wants weather.", "\n\nI will look.") if reasoning else (None, "I will look."))


@pytest.mark.parametrize("kind, reasoning", [("required", False), ("named", False),
                                             ("named", True)])
def test_a_forced_call_is_the_server_s_whole_response(tmp_path, monkeypatch, loaded, kind,
                                                      reasoning):
    """The call's opening is in the prompt (prompt_tokens as the server's; with thinking on,
    rendered as with it off) and parsed as the reply's start: the call comes back whole."""
    rest = ("<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call>")
    choice, reply = {"required": ("required", "<function=get_weather>\n" + rest),
                     "named": ({"type": "function", "function": {"name": "get_weather"}},
                               rest)}[kind]
    body = {**ASK, "tool_choice": choice, **({"chat_template_kwargs": {}} if reasoning else {})}
    flags = ["--tool-call-parser", "qwen3_coder", *(["--reasoning-parser", "qwen3"]
                                                    if reasoning else [])]
    with serving(loaded, **({"reasoning_parser": "qwen3"} if reasoning else {})) as srv:
        force_reply(srv.worker.engine, monkeypatch, reply)
        answer = post(srv, body)
    result, (record,) = run_batch(tmp_path, monkeypatch, loaded, [body], *flags, reply=reply)
    assert result.exit_code == 0, result.output
    choice, usage = answer["choices"][0], answer["usage"]
    assert without_ids(record["tool_calls"]) == without_ids(choice["message"]["tool_calls"])
    assert json.loads(record["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris",
                                                                             "days": 3}
    assert (record["text"], record["finish_reason"]) == ("", {"required": "tool_calls",
                                                              "named": "stop"}[kind])
    assert record.get("reasoning") is None and choice["message"].get("reasoning") is None
    assert record["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert record["usage"]["completion_tokens"] == usage["completion_tokens"]


def test_a_named_choice_s_line_ends_with_its_call(tmp_path, monkeypatch, loaded):
    """A model that goes on after the named call (a second call, text) is stopped at the
    call's end, as the server stops it: one call, finish_reason "stop", stop_reason null,
    completion_tokens those generated up to the call's end; a line's own stop inside the call
    cuts it there, as the server's."""
    rest = ("<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call>")
    reply = rest + "\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>\nDone."
    body = {**ASK, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    bodies = [body, {**body, "stop": "days"}]
    with serving(loaded) as srv:
        force_reply(srv.worker.engine, monkeypatch, reply)
        answers = [post(srv, b) for b in bodies]
    result, records = run_batch(tmp_path, monkeypatch, loaded, bodies,
                                "--tool-call-parser", "qwen3_coder", reply=reply)
    assert result.exit_code == 0, result.output
    for record, answer in zip(records, answers, strict=True):
        choice = answer["choices"][0]
        assert without_ids(record["tool_calls"]) == without_ids(choice["message"]["tool_calls"])
        assert (record["finish_reason"], record["stop_reason"]) == (choice["finish_reason"],
                                                                   choice["stop_reason"])
        assert record["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]
    whole_call, cut = records
    (made,) = whole_call["tool_calls"]
    assert json.loads(made["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert (whole_call["text"], whole_call["finish_reason"], whole_call["stop_reason"]) == (
        "", "stop", None)
    spelt = [i for ch in rest for i in loaded.tokenizer.encode(ch, add_special_tokens=False)]
    assert whole_call["usage"]["completion_tokens"] == len(spelt)
    (made,) = cut["tool_calls"]
    assert json.loads(made["function"]["arguments"]) == {"city": "Paris"}
    assert cut["stop_reason"] == "days"


def test_a_line_with_parallel_tool_calls_false_makes_one_call(tmp_path, monkeypatch, loaded):
    """A line's parallel_tool_calls is read as the server reads it: a model that writes two
    calls gives both by default, one (finish_reason "tool_calls", stop_reason null) with it
    false; a value that is not true or false is the line's error, the server's 400 message."""
    second = ("\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
              "</function>\n</tool_call>")
    reply = REPLY + second
    lines = [ASK, {**ASK, "parallel_tool_calls": False}, {**ASK, "parallel_tool_calls": "no"}]
    result, records = run_batch(tmp_path, monkeypatch, loaded, lines,
                                "--tool-call-parser", "qwen3_coder", reply=reply)
    assert result.exit_code == 0, result.output
    assert "ignored" not in result.stderr  # (parallel_tool_calls is read)
    both, one, bad = records
    assert [json.loads(c["function"]["arguments"])["city"] for c in both["tool_calls"]] == [
        "Paris", "Rome"]
    (made,) = one["tool_calls"]
    assert json.loads(made["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert (one["finish_reason"], one["stop_reason"]) == ("tool_calls", None)
    assert bad["error"]["message"] == "parallel_tool_calls must be true or false"


def test_a_bad_line_has_the_server_s_400_message_and_the_others_run(tmp_path, monkeypatch,
                                                                      loaded):
    with serving(loaded) as srv:
        answers = [post(srv, body) for body in BAD_BODIES]
    assert all(answer["status"] == 400 for answer in answers)
    result, records = run_batch(tmp_path, monkeypatch, loaded, [*BAD_BODIES, ASK],
                                "--tool-call-parser", "qwen3_coder")
    assert result.exit_code == 0, result.output
    assert [r["error"]["message"] for r in records[:-1]] == [
        answer["error"]["message"] for answer in answers]
    assert records[-1]["finish_reason"] == "tool_calls"
    assert f"{len(BAD_BODIES)} of {len(BAD_BODIES) + 1} requests failed" in result.stderr


def test_without_the_flag_tools_are_a_line_error_that_names_it(tmp_path, monkeypatch, loaded):
    """A line's tools were ignored (named on stderr), its reply not parsed; now, as in the
    server, tools, tool calls and tool messages are the line's error naming the flag, and
    the flag may come from $STATECHAT_TOOL_CALL_PARSER, as serve's does."""
    lines = [ASK, {**ASK, "tools": None, "messages": HISTORY[:2]},
             {**ASK, "tools": [], "messages": [HISTORY[0], {**HISTORY[2]}]},
             {**ASK, "tools": [], "tool_choice": "auto"}]
    result, records = run_batch(tmp_path, monkeypatch, loaded, lines)
    assert result.exit_code == 0, result.output
    assert all("--tool-call-parser qwen3_coder" in r["error"]["message"] and "statechat batch"
               in r["error"]["message"] for r in records[:3]), records
    assert records[3]["text"] == REPLY and records[3]["finish_reason"] == "stop"
    result, records = run_batch(tmp_path, monkeypatch, loaded, lines[:1],
                                env={"STATECHAT_TOOL_CALL_PARSER": "qwen3_coder"})
    assert result.exit_code == 0 and records[0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("flags, says", [
    (["--enable-auto-tool-choice"], ("--enable-auto-tool-choice needs --tool-call-parser "
                                     "qwen3_coder")),
    (["--tool-call-parser", "hermes"], "--tool-call-parser must be qwen3_coder, got 'hermes'"),
])
def test_a_bad_tool_flag_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, flags,
                                                            says):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(ASK) + "\n")
    monkeypatch.setattr(cli_setup, "load_engine", lambda config: pytest.fail("the model loaded"))
    monkeypatch.setattr("sys.argv", ["statechat", "batch", str(src), "--device", "cpu", *flags])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"statechat: {says}\n"
