"""tool_choice "required" and a named function under `serve --tool-call-parser qwen3_coder`, on
the tiny checkpoint whose template renders tools (tests/serving.py's TOOLS_TEMPLATE), replies
forced token by token: the engine's prompt is the rendered one with the call's opening after
it (with thinking on, rendered as with enable_thinking false, or its think block closed empty
where the template ignores that), counted in prompt_tokens; the opening and the model's
continuation parse into `tool_calls` for the function (finish_reason "tool_calls", "stop" for
a named function's, as OpenAI's and vLLM's), with no markup in the content, whole or streamed
alike (the random model's own replies too), beside a reasoning parser; a continuation that
makes no call gives what auto gives for the same text; a function not among the tools,
"required" without tools, another value and a tool name the parser cannot read are a 400
naming the field; without the flag they stay a 400 naming it."""

from __future__ import annotations

import json
import urllib.request

import pytest

from statechat.chat.template import render
from tests.helpers import force_reply
from tests.server.test_tools_server import reassembled, whole, without_ids
from tests.serving import (
    KEY,
    TOOLS,
    TOOLS_TEMPLATE,
    post,
    serving,
    tools_fixtures,
    tools_model,
)
from tests.serving import TOOLS_ASK as ASK

SHELL = {"type": "function", "function": {"name": "shell", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}
BOTH = [*TOOLS, SHELL]
ARGS = "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
REST = ARGS + "</function>\n</tool_call>"  # (a call to the named function, after its opening)
NAMED = {"type": "function", "function": {"name": "get_weather"}}
OPENING = {"required": "<tool_call>\n", "named": "<tool_call>\n<function=get_weather>\n"}
CHOICE = {"required": "required", "named": NAMED}
CONTINUED = {"required": "<function=get_weather>\n" + REST, "named": REST}
FINISH = {"required": "tool_calls", "named": "stop"}  # (OpenAI's and vLLM's for each)


loaded, server = tools_fixtures()


def submitted(server, monkeypatch) -> list[list[int]]:
    """The prompts the server's engine is handed from now on (a list that fills)."""
    worker, prompts = server.worker, []
    submit = worker.submit

    def spied(prompt_ids, *args, **kwargs):
        prompts.append(list(prompt_ids))
        return submit(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(worker, "submit", spied)
    return prompts


def encoded(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("kind", ["required", "named"])
def test_the_prompt_ends_with_the_call_s_opening(loaded, server, monkeypatch, kind):
    prompts = submitted(server, monkeypatch)
    force_reply(server.worker.engine, monkeypatch, CONTINUED[kind])
    reply = post(server, {**ASK, "tool_choice": CHOICE[kind]})
    rendered = render(loaded.tokenizer, ASK["messages"], True, ASK["chat_template_kwargs"], TOOLS)
    assert prompts == [rendered + encoded(loaded, OPENING[kind])]
    assert reply["usage"]["prompt_tokens"] == len(prompts[0])  # (the opening is prompt)


@pytest.mark.parametrize("kind", ["required", "named"])
def test_the_opening_and_its_continuation_are_the_function_s_call(server, monkeypatch, kind):
    forced = force_reply(server.worker.engine, monkeypatch, CONTINUED[kind])
    body = {**ASK, "tools": BOTH, "tool_choice": CHOICE[kind], "n": 2}
    choices = post(server, body)["choices"]
    chunks = post(server, {**body, "stream": True})
    for k, choice in enumerate(choices):
        got = whole(choice)
        assert got["finish_reason"] == FINISH[kind] and got["content"] is None
        (made,) = got["tool_calls"]
        assert made["function"]["name"] == "get_weather"
        assert json.loads(made["function"]["arguments"]) == {"city": "Paris", "days": 3}
        assert without_ids(reassembled(chunks, k)) == without_ids(got)
    usage = post(server, body)["usage"]
    # (the continuation alone; a named call's ends with its `</tool_call>`, no end of turn)
    assert usage["completion_tokens"] == 2 * (len(forced) - (kind == "named"))


def test_a_named_function_is_the_one_called_of_several(loaded, server, monkeypatch):
    prompts = submitted(server, monkeypatch)
    force_reply(server.worker.engine, monkeypatch,
                "<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>")
    body = {**ASK, "tools": BOTH, "tool_choice": {"type": "function",
                                                  "function": {"name": "shell"}}}
    message = post(server, body)["choices"][0]["message"]
    assert loaded.tokenizer.decode(prompts[0]).endswith(
        "</think>\n\n<tool_call>\n<function=shell>\n")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("shell", {"command": "ls"})]


@pytest.mark.parametrize("text", ["I am not sure.", "<function=nothing\nat all", ""])
def test_a_continuation_that_makes_no_call_gives_what_auto_gives(server, text):
    """("required"'s opening with no function after it is no call: its text is content. A
    held call's grammar never draws such text; an unheld one's may: here it is forced in.)"""
    with pytest.MonkeyPatch.context() as patch:
        force_reply(server.worker.engine, patch, text)
        forced = post(server, {**ASK, "tool_choice": "required"})
        streamed = post(server, {**ASK, "tool_choice": "required", "stream": True})
    with pytest.MonkeyPatch.context() as patch:  # (auto, its reply the same text whole)
        force_reply(server.worker.engine, patch, OPENING["required"] + text)
        auto = post(server, ASK)
    assert whole(forced["choices"][0]) == whole(auto["choices"][0])
    assert forced["choices"][0]["message"]["content"].startswith("<tool_call>")
    assert without_ids(reassembled(streamed, 0)) == without_ids(whole(forced["choices"][0]))


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_the_model_s_own_reply_streams_as_it_answers(server, choice):
    """The random model's greedy reply after the opening, whatever it is: the same whole or
    streamed; "required"'s is content (its opening included) unless it names a function."""
    body = {**ASK, "tool_choice": choice, "max_tokens": 24}
    answer = post(server, body)
    chunks = post(server, {**body, "stream": True})
    got = whole(answer["choices"][0])
    assert without_ids(reassembled(chunks, 0)) == without_ids(got)
    if choice == NAMED:  # (its opening names the function: a call, whatever follows)
        assert got["tool_calls"][0]["function"]["name"] == "get_weather"
    else:
        assert got["tool_calls"] or got["content"].startswith("<tool_call>")


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}])
def test_with_thinking_on_the_call_is_made_as_with_thinking_off(loaded, monkeypatch, kwargs):
    """A prompt that opens <think> is rendered as enable_thinking false renders it, then the
    call's opening: no reasoning (the reasoning parser finds none), the call parsed."""
    body = {**ASK, "chat_template_kwargs": kwargs, "tool_choice": NAMED}
    with serving(loaded, reasoning_parser="qwen3") as srv:
        prompts = submitted(srv, monkeypatch)
        force_reply(srv.worker.engine, monkeypatch, REST)
        answer = post(srv, body)
        chunks = post(srv, {**body, "stream": True})
    unthinking = render(loaded.tokenizer, ASK["messages"], True, {"enable_thinking": False},
                        TOOLS)
    assert prompts[0] == unthinking + encoded(loaded, OPENING["named"])
    got = whole(answer["choices"][0])
    assert got["reasoning"] is None and got["content"] is None
    assert json.loads(got["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert without_ids(reassembled(chunks, 0)) == without_ids(got)


def test_a_template_that_always_thinks_has_its_block_closed_empty(tmp_path, monkeypatch):
    template = TOOLS_TEMPLATE.split("{%- if enable_thinking")[0] + "{%- endif %}"
    loaded = tools_model(tmp_path / "tiny-always-thinks", template)
    with serving(loaded, reasoning_parser="qwen3") as srv:
        prompts = submitted(srv, monkeypatch)
        force_reply(srv.worker.engine, monkeypatch, "<function=get_weather>\n" + REST)
        got = whole(post(srv, {**ASK, "tool_choice": "required"})["choices"][0])
    text = loaded.tokenizer.decode(prompts[0], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n")
    assert got["reasoning"] is None and got["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("body, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "tool_choice names the function 'get_time', which is not among tools"),
    ({"tools": [], "tool_choice": NAMED}, "tool_choice", "not among tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice",
     'tool_choice "required" needs tools'),
    ({"tool_choice": "sometimes"}, "tool_choice", 'tool_choice must be "auto", "none", '),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": {"type": "allowed_tools", "function": {"name": "get_weather"}}},
     "tool_choice", "tool_choice must be"),
    ({"tool_choice": ["required"]}, "tool_choice", "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "a<b"}}]}, "tools[0].function.name",
     "without < or >"),
    ({"tools": [{"type": "function", "function": {"name": " f"}}]}, "tools[0].function.name",
     "white space at its ends"),
    ({"tools": [{"type": "function", "function": {"name": "f" * 257}}]},
     "tools[0].function.name", "at most 256 characters"),
])
def test_a_choice_or_name_the_server_cannot_serve_is_a_400_naming_it(server, body, param, says):
    """(A name holding `<` was taken, and its calls never parsed: their text was content.)"""
    answer = post(server, {**ASK, **body})
    assert answer["status"] == 400 and answer["error"]["param"] == param
    assert says in answer["error"]["message"]


def test_a_name_the_parser_reads_is_taken(server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, "<parameter=x>\n1\n</parameter>\n")
    tool = {"type": "function", "function": {"name": "my-tool.v2_x" + "y" * 244}}
    got = whole(post(server, {**ASK, "tools": [tool], "tool_choice": {
        "type": "function", "function": {"name": tool["function"]["name"]}}})["choices"][0])
    assert got["tool_calls"][0]["function"]["name"] == tool["function"]["name"]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_without_the_flag_a_forcing_choice_stays_a_400_naming_it(loaded, choice):
    with serving(loaded, tool_call_parser=None) as srv:
        answer = post(srv, {**ASK, "tools": None, "tool_choice": choice})
    assert answer["status"] == 400 and answer["error"]["param"] == "tool_choice"
    assert "--tool-call-parser qwen3_coder" in answer["error"]["message"]


def test_a_block_closed_empty_is_tokenized_as_the_template_writes_one(loaded):
    """Where "\\n\\n" is one token (Qwen's), the closed block is `<think>`, "\\n\\n", `</think>`
    as the template renders an empty one, not `<think>`, "\\n", "\\n" (the generation prompt's
    newline, then the closing text's own): a spelling the model never saw."""
    from transformers import AddedToken, AutoTokenizer

    from statechat.api_tools import ToolRequest, force_call

    tokenizer = AutoTokenizer.from_pretrained(loaded.path)
    tokenizer.add_tokens([AddedToken("\n\n", normalized=False)])
    prompt = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    forced = ToolRequest(TOOLS, True, OPENING["named"])
    got = force_call(prompt, forced, tokenizer, lambda: prompt)  # (a template that ignores it)
    assert got == tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"
                                   + OPENING["named"], add_special_tokens=False)


@pytest.mark.parametrize("kind", ["required", "named"])
def test_tokenize_counts_the_forced_opening_as_prompt_tokens(server, kind):
    """/tokenize of a chat with tool_choice "required" or a function counts the call's opening
    the engine is given, as the chat's prompt_tokens does."""
    body = {**ASK, "tools": TOOLS, "tool_choice": CHOICE[kind]}
    req = urllib.request.Request(f"{server.url}/tokenize", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        counted = json.loads(resp.read())
    reply = post(server, {**body, "max_tokens": 1})
    assert counted["count"] == reply["usage"]["prompt_tokens"]
    tokenizer = server.worker.engine.tokenizer
    assert tokenizer.decode(counted["tokens"]).endswith(OPENING[kind])
