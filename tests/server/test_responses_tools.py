"""POST /v1/responses with `--tool-call-parser qwen3_coder` and `--reasoning-parser qwen3`, on a
tiny checkpoint whose template renders tools and thinks (tests/serving.py's TOOLS_TEMPLATE),
replies forced token by token: a reply's thinking is a `reasoning` item, its text a `message`
item and its call a `function_call` item, whole or streamed alike (the stream with its
reasoning_text and function_call_arguments events); function_call and function_call_output
items, given or continued from a previous_response_id, render the conversation the chat API
renders, and are the continued response's input items (GET /v1/responses/ID/input_items); a
named tool_choice gives its call; reasoning.effort "none" turns the thinking off."""

from __future__ import annotations

import json

import pytest

from tests.helpers import force_reply
from tests.server.test_tool_choice import REST
from tests.serving import CALL, TOOLS, post, tools_fixtures

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
FLAT = [{"type": "function", **tool["function"]} for tool in TOOLS]  # (the Responses shape)
THOUGHT = "Let me see.</think>\n\nI will look.\n\n" + CALL
ASK = {"model": "m", "input": "Weather in Paris?", "tools": FLAT, "temperature": 0,
       "store": False}


loaded, server = tools_fixtures(reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def client(server):
    from tests.serving import KEY

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                       timeout=60) as c:
        yield c


def shown(item) -> dict:
    """An output item less its ids (made anew by each request) and status."""
    return item.model_dump(exclude={"id", "call_id", "status"}, exclude_none=True)


def test_reasoning_text_and_a_call_are_items_whole_and_streamed(client, server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, THOUGHT)
    made = client.responses.create(**ASK)
    reasoning, message, called = made.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me see."
    assert message.type == "message" and message.content[0].text.strip() == "I will look."
    assert called.type == "function_call" and called.name == "get_weather"
    assert called.call_id.startswith("call_") and called.id.startswith("fc_")
    assert json.loads(called.arguments) == {"city": "Paris", "days": 3}
    assert 0 < made.usage.output_tokens_details.reasoning_tokens < made.usage.output_tokens
    events = list(client.responses.create(**ASK, stream=True))
    kinds = [e.type for e in events]
    for kind in ("response.reasoning_text.delta", "response.output_text.delta",
                 "response.function_call_arguments.delta",
                 "response.function_call_arguments.done"):
        assert kind in kinds
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1, 2]
    final = events[-1].response
    assert [shown(i) for i in final.output] == [shown(i) for i in made.output]
    assert final.usage.output_tokens_details.reasoning_tokens == \
        made.usage.output_tokens_details.reasoning_tokens


def chat_prompt_tokens(server, messages: list[dict]) -> int:
    reply = post(server, {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 1})
    return reply["usage"]["prompt_tokens"]


def test_call_items_render_the_chat_conversation(client, server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, "Sunny.")
    arguments = '{"city": "Paris", "days": 3}'
    made = client.responses.create(**{**ASK, "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]})
    assert made.usage.input_tokens == chat_prompt_tokens(server, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}])


def test_a_call_continued_by_previous_response_id(client, server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, THOUGHT)
    first = client.responses.create(**{**ASK, "store": True})
    called = first.output[-1]
    force_reply(server.worker.engine, monkeypatch, "Sunny.")
    second = client.responses.create(**{**ASK, "previous_response_id": first.id, "input": [
        {"type": "function_call_output", "call_id": called.call_id, "output": "Sunny, 21 C"}]})
    assert second.usage.input_tokens == chat_prompt_tokens(server, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": first.output[1].content[0].text,
         "reasoning_content": "Let me see.", "tool_calls": [{
             "id": called.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": called.arguments}}]},
        {"role": "tool", "tool_call_id": called.call_id, "content": "Sunny, 21 C"}])
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_a_call_s_round_trip_is_the_next_response_s_input_items(client, monkeypatch, server):
    force_reply(server.worker.engine, monkeypatch, THOUGHT)
    first = client.responses.create(**{**ASK, "store": True})
    reasoning, message, called = first.output
    force_reply(server.worker.engine, monkeypatch, "Sunny.")
    second = client.responses.create(**{**ASK, "store": True, "previous_response_id": first.id,
                                        "input": [{"type": "function_call_output",
                                                   "call_id": called.call_id,
                                                   "output": "Sunny, 21 C"}]})
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [item.type for item in items] == ["message", "reasoning", "message", "function_call",
                                             "function_call_output"]
    asked, thought, said, call, answer = items
    assert asked.role == "user" and asked.content[0].text == "Weather in Paris?"
    assert shown(thought) == shown(reasoning) and thought.status == "completed"
    assert shown(said) == shown(message) and said.status == "completed"
    assert (call.call_id, call.name, call.arguments, call.status) == (
        called.call_id, "get_weather", called.arguments, "completed")
    assert (answer.call_id, answer.output) == (called.call_id, "Sunny, 21 C")
    assert call.id.startswith("fc_") and thought.id.startswith("rs_")
    assert said.id.startswith("msg_") and len({item.id for item in items}) == 5


def test_a_named_tool_choice_gives_its_call(client, server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, REST)
    made = client.responses.create(**ASK, tool_choice={"type": "function",
                                                       "name": "get_weather"})
    assert made.status == "completed" and made.tool_choice.name == "get_weather"
    (called,) = [item for item in made.output if item.type == "function_call"]
    assert json.loads(called.arguments) == {"city": "Paris", "days": 3}


def test_effort_none_turns_the_thinking_off(client, server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, "Plain answer.")
    thinking = client.responses.create(**ASK)
    assert [i.type for i in thinking.output] == ["reasoning", "message"]
    assert thinking.output[0].content[0].text == "Plain answer."
    assert thinking.output[1].content[0].text == ""
    assert thinking.usage.output_tokens_details.reasoning_tokens == thinking.usage.output_tokens
    plain = client.responses.create(**ASK, reasoning={"effort": "none"})
    assert [i.type for i in plain.output] == ["message"]
    assert plain.output_text == "Plain answer." and plain.reasoning.effort == "none"
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
