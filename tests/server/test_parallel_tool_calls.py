"""`parallel_tool_calls` (the chat and Responses APIs) and Anthropic's
`tool_choice.disable_parallel_tool_use` under `serve --tool-call-parser qwen3_coder`, honoured as
vLLM and OpenAI honour them, on the tiny checkpoint whose template renders tools, its replies
forced to write two calls: with parallel calls on (the default) the reply gives both; with them
off it ends where its first call closes, whole or streamed alike, for "auto" and "required":
one call, finish_reason "tool_calls" and stop_reason null (the stop the server added is not the
request's; completion_tokens counts the tokens up to that close), Anthropic's stop_reason
tool_use with one tool_use block, and one function_call item in a Responses response that
echoes the value honoured. A value that is not true or false is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from tests.helpers import force_reply
from tests.server.test_anthropic import call
from tests.server.test_anthropic_tools import ASK as ANTHROPIC_ASK
from tests.server.test_anthropic_tools import SHELL as ANTHROPIC_SHELL
from tests.server.test_anthropic_tools import streamed_content
from tests.server.test_tool_choice import BOTH, REST
from tests.server.test_tool_choice_named import spelt
from tests.server.test_tools_server import reassembled, whole, without_ids
from tests.serving import KEY, post, tools_fixtures
from tests.serving import TOOLS_ASK as ASK

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
OPEN = "<tool_call>\n<function=get_weather>\n"
SECOND = ("\n<tool_call>\n<function=shell>\n<parameter=command>\nls\n</parameter>\n"
          "</function>\n</tool_call>")
TWO = "I will look.\n" + OPEN + REST + SECOND  # (what the model writes for "auto")
WEATHER = {"city": "Paris", "days": 3}
FLAT = [{"type": "function", **tool["function"]} for tool in BOTH]  # (the Responses shape)


loaded, server = tools_fixtures(reasoning_parser="qwen3")


def names(calls: list[dict]) -> list[str]:
    return [c["function"]["name"] for c in calls]


@pytest.mark.parametrize("choice, reply", [
    ("auto", TWO), ("required", "<function=get_weather>\n" + REST + SECOND)])
def test_off_the_reply_ends_at_its_first_call(loaded, server, monkeypatch, choice, reply):
    force_reply(server.worker.engine, monkeypatch, reply)
    body = {**ASK, "tools": BOTH, "tool_choice": choice}
    for parallel, made in ((None, ["get_weather", "shell"]), (True, ["get_weather", "shell"]),
                           (False, ["get_weather"])):
        asked = body if parallel is None else {**body, "parallel_tool_calls": parallel}
        answer = post(server, asked)
        chunks = post(server, {**asked, "stream": True,
                               "stream_options": {"include_usage": True}})
        got = whole(answer["choices"][0])
        assert names(got["tool_calls"]) == made, parallel
        assert json.loads(got["tool_calls"][0]["function"]["arguments"]) == WEATHER
        assert got["finish_reason"] == "tool_calls"
        assert answer["choices"][0]["stop_reason"] is None
        assert without_ids(reassembled(chunks, 0)) == without_ids(got)
        (end,) = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert end["choices"][0]["stop_reason"] is None
    ended = reply[:reply.index("</tool_call>") + len("</tool_call>")]
    assert answer["usage"]["completion_tokens"] == len(spelt(loaded, ended))
    assert chunks[-1]["usage"]["completion_tokens"] == len(spelt(loaded, ended))


def test_off_a_request_s_own_stop_is_still_its_stop_reason(server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, TWO)
    body = {**ASK, "tools": BOTH, "parallel_tool_calls": False, "stop": ["</tool_call>"]}
    choice = post(server, body)["choices"][0]
    assert names(choice["message"]["tool_calls"]) == ["get_weather"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("tool_calls", "</tool_call>")


@pytest.mark.parametrize("value", ["no", 0, {}])
def test_a_value_that_is_not_true_or_false_is_a_400_naming_it(server, value):
    answer = post(server, {**ASK, "parallel_tool_calls": value})
    assert answer["status"] == 400
    assert answer["error"]["param"] == "parallel_tool_calls"
    assert "true or false" in answer["error"]["message"]


def test_anthropic_s_disable_parallel_tool_use_gives_one_tool_use(server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, TWO)
    body = {**ANTHROPIC_ASK, "max_tokens": 400,
            "tools": [*ANTHROPIC_ASK["tools"], ANTHROPIC_SHELL]}
    for choice, made in (({"type": "auto"}, 2), ({"type": "auto",
                                                  "disable_parallel_tool_use": False}, 2),
                         ({"type": "auto", "disable_parallel_tool_use": True}, 1)):
        asked = {**body, "tool_choice": choice}
        reply = call(server, asked)[1]
        uses = [b for b in reply["content"] if b["type"] == "tool_use"]
        assert len(uses) == made and uses[0]["input"] == WEATHER, choice
        assert (reply["stop_reason"], reply["stop_sequence"]) == ("tool_use", None)
        events = call(server, {**asked, "stream": True})[1]
        assert [b["input"] for b in streamed_content(events) if b["type"] == "tool_use"] == \
            [b["input"] for b in uses]
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_s_flag_of_another_type_is_a_400_naming_it(server):
    status, reply = call(server, {**ANTHROPIC_ASK, "tool_choice": {
        "type": "auto", "disable_parallel_tool_use": "yes"}})
    assert status == 400 and "tool_choice.disable_parallel_tool_use" in \
        reply["error"]["message"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                       timeout=60) as c:
        yield c


def test_responses_make_one_function_call_and_echo_the_value(client, server, monkeypatch):
    force_reply(server.worker.engine, monkeypatch, TWO)
    ask = {"model": "m", "input": "Weather in Paris?", "tools": FLAT, "temperature": 0,
           "store": False, "reasoning": {"effort": "none"}}
    for parallel, made in ((None, ["get_weather", "shell"]), (False, ["get_weather"])):
        asked = ask if parallel is None else {**ask, "parallel_tool_calls": parallel}
        response = client.responses.create(**asked)
        assert [i.name for i in response.output if i.type == "function_call"] == made
        assert response.parallel_tool_calls is (parallel is not False)
        final = list(client.responses.create(**asked, stream=True))[-1].response
        assert [i.name for i in final.output if i.type == "function_call"] == made
        assert final.parallel_tool_calls is (parallel is not False)
        assert response.status == final.status == "completed"
