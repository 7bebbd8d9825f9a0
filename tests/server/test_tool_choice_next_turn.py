"""The next turn after a call that tool_choice forced ("required", a named function) resumes
from the server's warm-up: the warm-up renders the forced call's message as the client sends it
back (the call's opening was in the prompt, not in the engine's text), so the request that
brings the tool's answer reuses the prefix up to that answer, with a template that thinks
(the forced prompt was rendered with enable_thinking false) and with one that does not."""

from __future__ import annotations

import pytest

from statechat.api_messages import parse_messages
from statechat.chat.next_turn import next_turn_prefix
from statechat.chat.template import render
from tests.helpers import force_reply
from tests.server.test_tools_server import wait_for_warm_up
from tests.serving import TOOLS, post, serving, tools_fixtures
from tests.serving import TOOLS_ASK as ASK

CITY = "Paris, " + "the city of light, " * 8
REST = f"<parameter=city>\n{CITY}\n</parameter>\n</function>\n</tool_call>"
CASES = {"required": ("required", "<function=get_weather>\n" + REST),
         "named": ({"type": "function", "function": {"name": "get_weather"}}, REST)}


loaded, _ = tools_fixtures()


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {}])
@pytest.mark.parametrize("kind", ["required", "named"])
def test_the_next_turn_after_a_forced_call_resumes_from_the_warm_up(loaded, monkeypatch, kind,
                                                                    kwargs):
    choice, reply = CASES[kind]
    ask = {**ASK, "chat_template_kwargs": kwargs}
    with serving(loaded, warm_next_turn=True, reasoning_parser="qwen3") as srv:
        force_reply(srv.worker.engine, monkeypatch, reply)
        message = post(srv, {**ask, "tool_choice": choice})["choices"][0]["message"]
        wait_for_warm_up(srv)
        (made,) = message["tool_calls"]
        assert made["function"]["name"] == "get_weather" and CITY in made["function"]["arguments"]
        sent_back = {"role": "assistant", "content": message["content"],
                     "tool_calls": message["tool_calls"]}
        answer = {"role": "tool", "tool_call_id": made["id"], "content": "Sunny"}
        turn = post(srv, {**ask, "messages": [*ask["messages"], sent_back, answer]})
    history = parse_messages([*ask["messages"], sent_back], tools=True)
    prefix = next_turn_prefix(lambda ms: render(loaded.tokenizer, ms, False, kwargs, TOOLS),
                              history)
    assert len(prefix) >= 2 * 64
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prefix) // 64 * 64


@pytest.mark.parametrize("kind", ["required", "named"])
def test_a_continued_message_s_forced_call_is_warmed_as_the_client_sends_it_back(
        loaded, monkeypatch, kind):
    """With continue_final_message, the client sends back its own start of the message and the
    reply's calls; the warm-up rendered the start and the call's markup as plain text (and a
    user's message after it, not the tool's answer), a prefix the next request never had."""
    choice, reply = CASES[kind]
    start = {"role": "assistant", "content": "Let me look that up."}
    body = {**ASK, "messages": [*ASK["messages"], start], "tool_choice": choice,
            "continue_final_message": True, "add_generation_prompt": False}
    with serving(loaded, warm_next_turn=True) as srv:
        force_reply(srv.worker.engine, monkeypatch, reply)
        message = post(srv, body)["choices"][0]["message"]
        wait_for_warm_up(srv)
        (made,) = message["tool_calls"]
        sent_back = {"role": "assistant", "content": start["content"] + (message["content"] or ""),
                     "tool_calls": message["tool_calls"]}
        answer = {"role": "tool", "tool_call_id": made["id"], "content": "Sunny"}
        turn = post(srv, {**ASK, "messages": [*ASK["messages"], sent_back, answer]})
    history = parse_messages([*ASK["messages"], sent_back], tools=True)
    prefix = next_turn_prefix(lambda ms: render(loaded.tokenizer, ms, False,
                                                ASK["chat_template_kwargs"], TOOLS), history)
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prefix) // 64 * 64
