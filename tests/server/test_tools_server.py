"""`serve --tool-call-parser qwen3_coder` end to end, on a tiny checkpoint whose chat template
(tests/helpers.py's TOOLS_TEMPLATE, in Qwen3.5's format) renders tools, an assistant's tool
calls and the tools' answers, with replies forced token by token: the prompt holds the tools
and the calls made (arguments sent as JSON strings, rendered as mappings; one that is not a
JSON object, a tool message without its tool_call_id and every other malformed call are a 400
naming the field); a reply's calls come back as `tool_calls` with finish_reason "tool_calls",
whole or streamed (the deltas reassemble to the whole reply's), for every choice of n, beside
a reasoning parser, through the openai client; tool_choice none, a request without tools and
malformed calls leave the text as content; a server without the flag refuses tools with a 400
that names it (tool_choice "required" and a named function: test_tool_choice.py); the next
turn's warm-up renders the tools and the calls."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from statechat.api_chat import chat_prompt
from statechat.api_messages import parse_messages
from statechat.api_request import ApiError
from statechat.api_tools import parse_tools
from statechat.chat.next_turn import next_turn_prefix
from statechat.chat.template import render
from tests.helpers import force_reply
from tests.serving import (
    CALL,
    KEY,
    REPLY,
    TOOLS,
    TOOLS_TEMPLATE,
    post,
    serving,
    tools_fixtures,
    tools_model,
)
from tests.serving import TOOLS_ASK as ASK
from tests.serving import TOOLS_HISTORY as HISTORY

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

loaded, server = tools_fixtures()


def reassembled(chunks: list[dict], index: int) -> dict:
    """A streamed choice put together as a whole reply's message, and its finish_reason."""
    message, calls, finish = {"content": "", "reasoning": ""}, {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning"] += delta.get("reasoning") or ""
            for part in delta.get("tool_calls", []):
                made = calls.setdefault(part["index"], {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    assert key not in part or key not in made, "an id or type sent twice"
                    made.update({key: part[key]} if key in part else {})
                made["function"].setdefault("name", part["function"].get("name"))
                made["function"]["arguments"] += part["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    return {"content": message["content"] or None, "reasoning": message["reasoning"] or None,
            "tool_calls": [calls[k] for k in sorted(calls)], "finish_reason": finish}


def whole(choice: dict) -> dict:
    message = choice["message"]
    return {"content": message["content"], "reasoning": message.get("reasoning"),
            "tool_calls": message.get("tool_calls", []),
            "finish_reason": choice["finish_reason"]}


def without_ids(result: dict) -> dict:
    assert all(c["id"].startswith("call_") for c in result["tool_calls"])
    return {**result, "tool_calls": [{**c, "id": None} for c in result["tool_calls"]]}


def prompt_text(loaded, body: dict) -> str:
    worker = SimpleNamespace(render=lambda messages, add, template_kwargs, tools, **_: render(
        loaded.tokenizer, messages, add, template_kwargs, tools))
    ids = chat_prompt(worker, body, {}, parse_tools(body, "qwen3_coder"))
    return loaded.tokenizer.decode(ids)


def test_the_prompt_holds_the_tools_and_the_calls_made(loaded):
    text = prompt_text(loaded, {"messages": HISTORY, "tools": TOOLS})
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert ("<|im_start|>assistant\n\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>") in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text


@pytest.mark.parametrize("arguments", ['"Paris"', "[1, 2]", "{'city': 'Paris'}", "{", 5,
                                       '{"a": ' + "[" * 5000 + "]" * 5000 + "}"])
def test_arguments_that_are_not_a_json_object_are_a_400_naming_them(loaded, arguments):
    history = json.loads(json.dumps(HISTORY))
    history[1]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(ApiError) as bad:
        prompt_text(loaded, {"messages": history, "tools": TOOLS})
    assert bad.value.status == 400
    assert bad.value.param == "messages[1].tool_calls[0].function.arguments"


def _edited(path: str, value) -> list[dict]:
    """HISTORY with the field at `path` (dotted; `-` deletes it) set to `value`."""
    history = json.loads(json.dumps(HISTORY))
    *keys, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    where = history
    for key in keys:
        where = where[key]
    if value == "-":
        del where[last]
    else:
        where[last] = value
    return history


@pytest.mark.parametrize("path, value, param", [
    ("2.tool_call_id", "-", "messages[2].tool_call_id"),
    ("2.tool_call_id", None, "messages[2].tool_call_id"),
    ("0.tool_calls", HISTORY[1]["tool_calls"], "messages[0].tool_calls"),
    ("1.tool_calls.0.function", "-", "messages[1].tool_calls[0].function"),
    ("1.tool_calls.0.function.name", "-", "messages[1].tool_calls[0].function.name"),
    ("1.tool_calls.0.function.name", "", "messages[1].tool_calls[0].function.name"),
    ("1.tool_calls.0.type", "code", "messages[1].tool_calls[0].type"),
    ("1.tool_calls.0.id", 7, "messages[1].tool_calls[0].id"),
    ("1.tool_calls.0", "call", "messages[1].tool_calls[0]"),
])
def test_a_malformed_tool_message_or_call_is_a_400_naming_the_field(loaded, path, value, param):
    """(A tool message without its tool_call_id, and a user's tool calls, were taken: the
    calls dropped, the answer rendered as if it answered nothing.)"""
    with pytest.raises(ApiError) as bad:
        prompt_text(loaded, {"messages": _edited(path, value), "tools": TOOLS})
    assert (bad.value.status, bad.value.param) == (400, param)
    assert bad.value.message.startswith(param)


def test_a_reply_with_a_call_is_parsed_for_each_choice(server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, REPLY)
    reply = post(server, {**ASK, "n": 2})
    for choice in reply["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] == "I will look."
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("text", [
    REPLY, CALL + "\n" + CALL.replace("Paris", "Oslo"), "Just text, no call.",
    "I will look.\n<tool_call>\nnot a call\n</tool_call>",
])
def test_a_streams_deltas_reassemble_to_the_whole_reply(server, monkeypatch, text):
    force_reply(server.worker.engine, monkeypatch, text)
    expected = [without_ids(whole(c)) for c in post(server, {**ASK, "n": 2})["choices"]]
    chunks = post(server, {**ASK, "n": 2, "stream": True})
    assert [without_ids(reassembled(chunks, k)) for k in range(2)] == expected
    for k in range(2):  # (content first: none after the first call's entry)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == k]
        first = next((i for i, d in enumerate(deltas) if "tool_calls" in d), len(deltas))
        assert not any(d.get("content") for d in deltas[first:])


def test_cut_inside_a_call_the_call_is_kept_and_the_reply_says_length(server, monkeypatch):
    forced = force_reply(server.worker.engine, monkeypatch, REPLY)
    cut = len(forced) - 30  # (inside `3`'s </parameter>)
    choice = post(server, {**ASK, "max_tokens": cut})["choices"][0]
    assert choice["finish_reason"] == "length"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris", "days": 3}


@pytest.mark.parametrize("body", [{"tool_choice": "none"}, {"tools": []}, {"tools": None}])
def test_without_tools_to_call_the_text_stays_content(server, monkeypatch, body):
    force_reply(server.worker.engine, monkeypatch, REPLY)
    choice = post(server, {**ASK, **body})["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param, says", [
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": {"type": "function"}}, "tools", "tools must be an array"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", 'type "function"'),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name",
     "a name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "an object"),
])
def test_bad_tools_are_a_400_naming_the_field(server, body, param, says):
    answer = post(server, {**ASK, **body})
    assert answer["status"] == 400 and answer["error"]["param"] == param
    assert says in answer["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": None, "messages": HISTORY[:2]}, "messages[1].tool_calls"),
    ({"tools": None, "messages": [*HISTORY[:1], {**HISTORY[2]}]}, "messages[1].role"),
])
def test_a_server_without_the_flag_says_which_flag_enables_tools(loaded, body, param):
    with serving(loaded, tool_call_parser=None) as srv:
        answer = post(srv, {**ASK, **body})
        assert answer["status"] == 400 and answer["error"]["param"] == param
        assert "--tool-call-parser qwen3_coder" in answer["error"]["message"]
        plain = post(srv, {**ASK, "tools": [], "tool_choice": "auto"})  # (off values: taken)
        assert plain["choices"][0]["message"]["role"] == "assistant"


def test_reasoning_then_calls_with_both_parsers(loaded, monkeypatch):
    thought = "The user wants weather.</think>\n\n"
    body = {**ASK, "chat_template_kwargs": {}, "n": 2}
    with serving(loaded, reasoning_parser="qwen3") as srv:
        force_reply(srv.worker.engine, monkeypatch, thought + REPLY)
        choices = post(srv, body)["choices"]
        chunks = post(srv, {**body, "stream": True})
    for k, choice in enumerate(choices):
        got = whole(choice)
        assert got["reasoning"] == "The user wants weather."
        # (the answer keeps the blank line after </think>, as without tools)
        assert got["content"] == "\n\nI will look." and got["finish_reason"] == "tool_calls"
        assert json.loads(got["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
        assert without_ids(reassembled(chunks, k)) == without_ids(got)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == k]
        last_reasoning = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
        assert not any("content" in d or "tool_calls" in d for d in deltas[1:last_reasoning])


def test_the_openai_client_reads_the_calls_and_sends_them_back(server, client_of,
                                                                monkeypatch):
    force_reply(server.worker.engine, monkeypatch, REPLY)
    client = client_of(server)
    ask = {**{k: v for k, v in ASK.items() if k != "chat_template_kwargs"},
           "extra_body": {"chat_template_kwargs": ASK["chat_template_kwargs"]}}
    reply = client.chat.completions.create(**ask)
    call = reply.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris", "days": 3})
    streamed = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True)
                if c.choices]
    parts = [p for d in streamed for p in d.tool_calls or []]
    assert parts[0].function.name == "get_weather" and parts[0].id.startswith("call_")
    assert json.loads("".join(p.function.arguments or "" for p in parts))["days"] == 3
    again = client.chat.completions.create(**{**ask, "messages": [
        *ASK["messages"], reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]})
    assert again.choices[0].finish_reason == "tool_calls"


@pytest.fixture
def client_of():
    made = []

    def make(server):
        made.append(openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                  timeout=60))
        return made[-1]

    yield make
    for client in made:
        client.close()


def wait_for_warm_up(srv) -> None:
    """Until the server's first next-turn warm-up has been made and has finished."""
    deadline = time.monotonic() + 60
    while srv.next_turns.considered < 1 or srv.next_turns.last is None:
        assert time.monotonic() < deadline, "no warm-up was made"
        time.sleep(0.02)
    srv.next_turns.last.result(timeout=60)


def test_the_next_turn_after_a_call_resumes_from_the_warm_up(loaded, monkeypatch):
    """The warm-up after a reply with calls renders the tools and the calls as the client
    sends them back (here otherwise than the model wrote them: one newline before the call,
    where the template writes two), so the request with the tool's answer resumes past the
    reply."""
    long_call = CALL.replace("Paris", "Paris, " + "the city of light, " * 8)
    with serving(loaded, warm_next_turn=True) as srv:
        force_reply(srv.worker.engine, monkeypatch, "I will look.\n" + long_call)
        message = post(srv, ASK)["choices"][0]["message"]
        wait_for_warm_up(srv)
        sent_back = {"role": "assistant", "content": message["content"],
                     "tool_calls": message["tool_calls"]}
        answer = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                  "content": "Sunny"}
        reply = post(srv, {**ASK, "messages": [*ASK["messages"], sent_back, answer]})
    history = parse_messages([*ASK["messages"], sent_back], tools=True)
    prefix = next_turn_prefix(lambda ms: render(loaded.tokenizer, ms, False, None, TOOLS),
                              history)
    assert len(prefix) >= 2 * 64
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prefix) // 64 * 64


# TOOLS_TEMPLATE with Qwen3.5's rule for reasoning: an assistant turn after the last user
# message (a tool loop's) is rendered with its reasoning, an earlier one without
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    + TOOLS_TEMPLATE.replace(
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}",
        "{%- else %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' and loop.index0 > ns.last and m.reasoning_content %}"
        "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
        "{{- m.content }}")
)


def test_the_warm_up_after_a_call_renders_the_reasoning_as_the_tool_loop_does(
        tmp_path, monkeypatch):
    """With Qwen3.5's rule, the request that brings a tool's answer renders the calling turn
    with its reasoning (no user message after it); the warm-up rendered it as if a user
    message came next, without it, and that prefix was never reused. It probes with a tool's
    answer after a reply with calls, so the tool loop's next request resumes past it."""
    loaded = tools_model(tmp_path / "tiny-thinking-tools", THINKING_TEMPLATE)
    thought = "The user wants the weather of " + "a city, " * 6 + "so I call the tool.</think>\n"
    ask = {**ASK, "chat_template_kwargs": {}}
    with serving(loaded, warm_next_turn=True, reasoning_parser="qwen3") as srv:
        force_reply(srv.worker.engine, monkeypatch, thought + "I will look.\n" + CALL)
        message = post(srv, ask)["choices"][0]["message"]
        wait_for_warm_up(srv)
        assert message["reasoning"] and message["tool_calls"]
        history = [*ask["messages"], message]
        answers = [{"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                    "content": text} for text in ("Sunny", "Rainy")]
        reply = post(srv, {**ask, "messages": [*history, answers[0]]})
    a, b = (render(loaded.tokenizer, parse_messages([*history, answer], tools=True), False,
                   None, TOOLS) for answer in answers)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # (up to the answer)
    assert "<think>" in loaded.tokenizer.decode(a[:shared])
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // 64 * 64
