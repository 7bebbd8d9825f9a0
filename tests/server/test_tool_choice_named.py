"""A named tool_choice under `serve --tool-call-parser qwen3_coder` gives exactly one call to
the function, as vLLM's guided decoding and OpenAI do: the reply ends where the forced call's
`</tool_call>` is generated (a model that goes on to a second call, or text, is stopped there),
whole or streamed, for every choice of n, with finish_reason "stop" and stop_reason null (the
model's own end, as vLLM's), and completion_tokens the tokens generated up to that tag. A
request's own stop that matches inside the call ends it there (the call holds the parameters
read so far, stop_reason the request's stop); max_tokens inside it gives "length" and the call
so far; a request with the most stop strings allowed already is a 400 naming stop."""

from __future__ import annotations

import json

import pytest

from statechat.engine.sampling import MAX_STOPS
from tests.helpers import force_reply
from tests.server.test_tool_choice import BOTH, NAMED, REST
from tests.server.test_tools_server import reassembled, whole, without_ids
from tests.serving import TOOLS_ASK as ASK
from tests.serving import post, tools_fixtures

SECOND = ("\n<tool_call>\n<function=shell>\n<parameter=command>\nls\n</parameter>\n"
          "</function>\n</tool_call>\nDone.")  # (what a model may write after the named call)


loaded, server = tools_fixtures()


def spelt(loaded, text: str) -> list[int]:
    """`text`'s token ids as force_reply spells them (a character at a time)."""
    return [i for ch in text for i in loaded.tokenizer.encode(ch, add_special_tokens=False)]


def test_the_reply_ends_with_the_named_call(loaded, server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, REST + SECOND)
    body = {**ASK, "tools": BOTH, "tool_choice": NAMED, "n": 2}
    answer = post(server, body)
    chunks = post(server, {**body, "stream": True, "stream_options": {"include_usage": True}})
    for k, choice in enumerate(answer["choices"]):
        got = whole(choice)
        (made,) = got["tool_calls"]
        assert made["function"]["name"] == "get_weather"
        assert json.loads(made["function"]["arguments"]) == {"city": "Paris", "days": 3}
        assert (got["content"], got["finish_reason"], choice["stop_reason"]) == (None, "stop",
                                                                                  None)
        assert without_ids(reassembled(chunks, k)) == without_ids(got)
        (end,) = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == k
                  and c["choices"][0]["finish_reason"]]
        assert end["choices"][0]["stop_reason"] is None
    # (generated up to the call's end, its tag included: not the second call's tokens)
    assert answer["usage"]["completion_tokens"] == 2 * len(spelt(loaded, REST))
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(spelt(loaded, REST))


@pytest.mark.parametrize("stop, arguments, stop_reason", [
    ("days", {"city": "Paris"}, "days"),  # (the request's stop, inside the call: cut there)
    ("Done", {"city": "Paris", "days": 3}, None),  # (after the call: the call's end first)
    ("</tool_call>", {"city": "Paris", "days": 3}, "</tool_call>"),  # (the request's own)
])
def test_a_request_s_stop_ends_the_call_where_it_matches(server, monkeypatch, stop, arguments,
                                                         stop_reason):
    force_reply(server.worker.engine, monkeypatch, REST + SECOND)
    body = {**ASK, "tools": BOTH, "tool_choice": NAMED, "stop": [stop]}
    choice = post(server, body)["choices"][0]
    chunks = post(server, {**body, "stream": True})
    got = whole(choice)
    (made,) = got["tool_calls"]
    assert json.loads(made["function"]["arguments"]) == arguments
    assert (got["finish_reason"], choice["stop_reason"]) == ("stop", stop_reason)
    assert without_ids(reassembled(chunks, 0)) == without_ids(got)


def test_max_tokens_inside_the_call_gives_length_and_the_call_so_far(loaded, server,
                                                                     monkeypatch):
    force_reply(server.worker.engine, monkeypatch, REST + SECOND)
    cut = len(spelt(loaded, REST.split("<parameter=days>")[0]))  # (up to the second value)
    body = {**ASK, "tool_choice": NAMED, "max_tokens": cut}
    answer = post(server, body)
    got = whole(answer["choices"][0])
    (made,) = got["tool_calls"]
    assert json.loads(made["function"]["arguments"]) == {"city": "Paris"}
    assert got["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == cut
    assert without_ids(reassembled(post(server, {**body, "stream": True}), 0)) == \
        without_ids(got)


def test_the_most_stops_and_a_named_choice_is_a_400_naming_stop(server):
    stops = [f"s{k}" for k in range(MAX_STOPS)]
    answer = post(server, {**ASK, "tool_choice": NAMED, "stop": stops})
    assert answer["status"] == 400 and answer["error"]["param"] == "stop"
    assert f"at most {MAX_STOPS - 1}" in answer["error"]["message"]
    assert post(server, {**ASK, "tool_choice": "auto", "stop": stops})["choices"]
