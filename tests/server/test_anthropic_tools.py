"""Tools and thinking in Anthropic's Messages API on `serve --tool-call-parser qwen3_coder
--reasoning-parser qwen3`, with replies forced token by token on a tiny checkpoint whose
template renders tools (tests/serving.py's): a reply's call is a tool_use block (its input an
object) with stop_reason tool_use, whole or streamed (input_json_delta; the stream's blocks put
together are the whole reply's); tool_use and tool_result blocks render the prompt the chat
API renders for the same calls and answers; tool_choice any and tool force a call as the chat
API's required and named function do; `thinking` enabled gives a thinking block apart from
the text, disabled renders the prompt without thinking; malformed tool blocks and tools are
Anthropic-shaped 400s naming Anthropic's field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from statechat.api_anthropic import chat_body
from statechat.api_chat import chat_prompt
from statechat.api_tools import parse_tools
from statechat.chat.template import render
from tests.helpers import force_reply
from tests.server.test_anthropic import call
from tests.server.test_tool_choice import CONTINUED
from tests.serving import REPLY, TOOLS, tools_fixtures
from tests.serving import TOOLS_HISTORY as HISTORY

TOOL = {"name": "get_weather", "description": TOOLS[0]["function"]["description"],
        "input_schema": TOOLS[0]["function"]["parameters"]}
SHELL = {"name": "shell", "input_schema": {"type": "object", "properties": {
    "command": {"type": "string"}}}}
ASK = {"model": "claude-any", "max_tokens": 200, "temperature": 0, "tools": [TOOL],
       "thinking": {"type": "disabled"},
       "messages": [{"role": "user", "content": "Weather in Paris?"}]}
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                       "input": {"city": "Paris", "days": 3}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                  "content": [{"type": "text", "text": "Sunny, 21 C"}]}]},
]


loaded, server = tools_fixtures(reasoning_parser="qwen3")


def streamed_content(events: list) -> list[dict]:
    """A stream's content blocks put together (a tool_use's input from its JSON deltas)."""
    blocks = {}
    for name, data in events:
        if name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"])
            if blocks[data["index"]]["type"] == "tool_use":
                blocks[data["index"]]["json"] = ""
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking",
                   "input_json_delta": "json"}[delta["type"]]
            block[key] += delta["partial_json" if key == "json" else key]
    for block in blocks.values():
        if "json" in block:
            block["input"] = json.loads(block.pop("json") or "{}")
    return [blocks[k] for k in sorted(blocks)]


def without_ids(content: list[dict]) -> list[dict]:
    assert all(b["id"].startswith("toolu_") for b in content if b["type"] == "tool_use")
    return [{k: v for k, v in b.items() if k != "id"} for b in content]


def test_a_reply_with_a_call_is_a_tool_use_block_whole_or_streamed(server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, REPLY)
    reply = call(server, ASK)[1]
    assert without_ids(reply["content"]) == [
        {"type": "text", "text": "I will look."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "days": 3}}]
    assert reply["stop_reason"] == "tool_use"
    events = call(server, {**ASK, "stream": True})[1]
    assert without_ids(streamed_content(events)) == without_ids(reply["content"])
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1]


def prompt_of(loaded, chat: dict) -> str:
    """The prompt text the chat path renders for a chat body."""
    worker = SimpleNamespace(render=lambda messages, add, template_kwargs, tools, **_: render(
        loaded.tokenizer, messages, add, template_kwargs, tools))
    return loaded.tokenizer.decode(chat_prompt(worker, chat, {}, parse_tools(chat, "qwen3_coder")))


def test_tool_use_and_tool_result_render_the_chats_prompt(loaded, server):
    chat, _ = chat_body({**ASK, "messages": ROUND_TRIP}, tools_on=True)
    openai = {"messages": HISTORY, "tools": TOOLS,
              "chat_template_kwargs": {"enable_thinking": False}}
    assert prompt_of(loaded, chat) == prompt_of(loaded, openai)
    count = call(server, {**ASK, "messages": ROUND_TRIP}, "/v1/messages/count_tokens")[1]
    status, reply = call(server, {**ASK, "messages": ROUND_TRIP, "max_tokens": 4})
    assert status == 200 and reply["usage"]["input_tokens"] + reply["usage"][
        "cache_read_input_tokens"] == count["input_tokens"]
    failed = json.loads(json.dumps(ROUND_TRIP))
    failed[2]["content"][0].update(is_error=True, content="no such city")
    chat, _ = chat_body({**ASK, "messages": failed}, tools_on=True)
    assert "<tool_response>\nError: no such city\n</tool_response>" in prompt_of(loaded, chat)


@pytest.mark.parametrize("choice, forced", [({"type": "any"}, "required"),
                                            ({"type": "tool", "name": "get_weather"}, "named")])
def test_tool_choice_any_and_tool_force_a_call(server, monkeypatch, choice, forced):
    force_reply(server.worker.engine, monkeypatch, CONTINUED[forced] + "\nDone.")
    reply = call(server, {**ASK, "tools": [TOOL, SHELL], "tool_choice": choice})[1]
    assert without_ids(reply["content"])[-1] == {
        "type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "days": 3}}
    assert reply["stop_reason"] == "tool_use"
    if forced == "named":  # (one call, then the end: the text after it is not generated)
        assert len(reply["content"]) == 1


def test_thinking_enabled_is_a_thinking_block_and_disabled_is_text(server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, "Let me see.</think>\n\nIt is sunny.")
    thinking = {**ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    reply = call(server, thinking)[1]
    assert reply["content"] == [{"type": "thinking", "thinking": "Let me see.", "signature": ""},
                                {"type": "text", "text": "\n\nIt is sunny."}]
    events = call(server, {**thinking, "stream": True})[1]
    assert streamed_content(events) == reply["content"]
    assert {d["delta"]["type"] for n, d in events if n == "content_block_delta"} == {
        "thinking_delta", "text_delta"}
    plain = call(server, ASK)[1]  # (the prompt closed the think block: all of it is text)
    assert plain["content"] == [{"type": "text", "text": "Let me see.</think>\n\nIt is sunny."}]


@pytest.mark.parametrize("edit, param", [
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f",
                                                 "input": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [*ROUND_TRIP[:1], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "x", "name": "get_weather", "input": "Paris"}]}]},
     "messages[1].content[0].input"),
    ({"messages": [*ROUND_TRIP[:2], {"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "messages[2].content[0].tool_use_id"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**TOOL, "input_schema": "object"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "tool", "name": "shell"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"thinking": {"type": "on"}}, "thinking"),
])
def test_malformed_tools_and_blocks_are_anthropic_400s_naming_the_field(server, edit, param):
    status, error = call(server, {**ASK, **edit})
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param)
