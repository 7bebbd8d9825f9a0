"""POST /v1/responses (OpenAI's Responses API) through the openai client and raw HTTP, on the tiny
model: a string input and message items with instructions (joined to an opening developer
message) give the reply (and the usage) the chat API gives for the same conversation; a stream's
events come in OpenAI's order with increasing sequence numbers and its deltas join to the whole
reply's text; max_output_tokens makes an "incomplete" response; text.format json_schema holds
the reply to the schema; a previous_response_id continues the stored conversation and reports
the engine's own reuse as cached_tokens; GET and DELETE find and forget a stored response (404s
after; a path under one other than input_items, tested in test_responses_items.py, such as
OpenAI's cancel, is no route), and the store keeps the latest
within its bounds; a client that leaves a stream aborts its reply, and a failure once a stream
began is an `error` event then response.failed (a whole response's is a 500 of one line); bad
fields are 400s naming them in one line."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from statechat.api_choices import Choices
from statechat.api_responses_store import ResponseStore
from tests.server.conftest import left_and_aborted
from tests.server.test_server import words
from tests.serving import KEY, post

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # (a random model writes no padding)


def call(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON answer, headers) of a raw request."""
    req = urllib.request.Request(f"{server.url}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def chat_reply(server, messages: list[dict], **fields) -> dict:
    reply = post(server, {"model": "m", "messages": messages, **fields})
    assert "error" not in reply, reply
    return reply


def test_a_string_input_is_answered_as_the_chat_api_answers_it(client, server):
    made = client.responses.create(model="m", input="Hello there", max_output_tokens=8,
                                   temperature=0, store=False)
    assert made.object == "response" and made.id.startswith("resp_")
    assert made.status in ("completed", "incomplete") and made.model == "tiny-qwen3.5"
    (item,) = made.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    chat = chat_reply(server, [{"role": "user", "content": "Hello there"}], max_tokens=8,
                      temperature=0)
    assert made.output_text == chat["choices"][0]["message"]["content"]
    assert made.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert made.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens
    assert made.usage.output_tokens_details.reasoning_tokens == 0
    assert made.temperature == 0 and made.max_output_tokens == 8 and made.store is False


def test_items_and_instructions_make_the_chat_conversation(client, server):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Name "},
                                          {"type": "input_text", "text": "a colour."}]}]
    made = client.responses.create(model="m", input=items, instructions="You are terse.",
                                   max_output_tokens=6, temperature=0, store=False)
    chat = chat_reply(server, [{"role": "system", "content": "You are terse.\n\nBe brief."},
                               {"role": "assistant", "content": "Hi."},
                               {"role": "user", "content": "Name a colour."}],
                      max_tokens=6, temperature=0)
    assert made.output_text == chat["choices"][0]["message"]["content"]
    assert made.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert made.instructions == "You are terse."


def test_a_stream_gives_the_events_in_order_and_the_same_text(client):
    ask = {"model": "m", "input": "Tell me a story", "max_output_tokens": 12,
           "temperature": 1.0, "store": False, "extra_body": {"seed": 7}}
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    ending = ["response.output_text.done", "response.content_part.done",
              "response.output_item.done"]
    assert kinds[-4:-1] == ending and kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and final.id == events[0].response.id


def test_max_output_tokens_makes_an_incomplete_response(client):
    ask = {"model": "m", "input": "Go on", "max_output_tokens": 3, "store": False,
           "extra_body": {"ignore_eos": True}}
    made = client.responses.create(**ask)
    assert made.status == "incomplete" and made.incomplete_details.reason == "max_output_tokens"
    assert made.output[0].status == "incomplete" and made.usage.output_tokens == 3
    events = list(client.responses.create(**ask, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_text_format_json_schema_holds_the_reply(client):
    made = client.responses.create(
        model="m", input="Pick.", max_output_tokens=40, store=False,
        text={"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA,
                         "strict": True}})
    value = json.loads(made.output_text)
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
    assert made.status == "completed" and made.text.format.type == "json_schema"


def test_previous_response_id_continues_and_reports_the_engines_reuse(client, server,
                                                                      monkeypatch):
    first = client.responses.create(model="m", input=words(3, 150), instructions="Be kind.",
                                    max_output_tokens=6, temperature=0)
    handles, submit = [], server.worker.submit
    monkeypatch.setattr(server.worker, "submit",
                        lambda *a, **k: handles.append(submit(*a, **k)) or handles[-1])
    second = client.responses.create(model="m", input="And then?", instructions="Be kind.",
                                     previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    (handle,) = handles
    out = handle.result(timeout=30)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == out.num_cached_tokens and cached >= first.usage.input_tokens // 64 * 64 > 0
    assert second.usage.input_tokens == out.num_prompt_tokens == cached + out.num_computed_tokens
    assert second.previous_response_id == first.id
    chat = chat_reply(server, [{"role": "system", "content": "Be kind."},
                               {"role": "user", "content": words(3, 150)},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "And then?"}],
                      max_tokens=6, temperature=0)
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert second.output_text == chat["choices"][0]["message"]["content"]


def test_get_and_delete_a_stored_response(client, server):
    made = client.responses.create(model="m", input="Keep me", max_output_tokens=4)
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    status, answer, _ = call(server, "DELETE", f"/v1/responses/{made.id}")
    assert status == 200 and answer == {"id": made.id, "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        status, answer, _ = call(server, method, f"/v1/responses/{made.id}")
        assert status == 404 and answer["error"]["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", input="more", previous_response_id=made.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="m", input="Forget me", max_output_tokens=2,
                                       store=False)
    assert call(server, "GET", f"/v1/responses/{unstored.id}")[0] == 404


def test_other_methods_are_405s_naming_the_routes(server):
    status, answer, headers = call(server, "GET", "/v1/responses")
    assert status == 405 and headers["Allow"] == "POST"
    assert "POST /v1/chat/completions, /v1/completions, /v1/responses" in \
        answer["error"]["message"]
    status, _, headers = call(server, "PUT", "/v1/responses/resp_x")
    assert status == 405 and headers["Allow"] == "GET, HEAD, DELETE"


def test_a_path_under_a_stored_response_is_no_route(client, server):
    """OpenAI's cancel is not served: a 404 saying there is no such route, not one saying that
    a stored response is not stored."""
    made = client.responses.create(model="m", input="Keep me", max_output_tokens=2)
    for method, path in (("GET", "cancel"), ("POST", "cancel"), ("GET", "input_items/x")):
        status, answer, _ = call(server, method, f"/v1/responses/{made.id}/{path}")
        assert status == 404 and answer["error"]["code"] == "not_found", answer
        assert answer["error"]["message"] == f"no route {method} /v1/responses/{made.id}/{path}"
    assert client.responses.retrieve(made.id).id == made.id


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "input[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"temperature": "hot"}, "temperature"),
    ({"instructions": 3}, "instructions"),
    ({"previous_response_id": "resp_none"}, "previous_response_id"),
    ({"previous_response_id": 5}, "previous_response_id"),
    # (a json_schema format with no schema, the chat API's nesting too: not any JSON)
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}},
     "text.format.schema"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"user": 5}, "user"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_fields_are_400s_naming_them(server, fields, param):
    status, answer, _ = call(server, "POST", "/v1/responses",
                             {"model": "m", "input": "hi", **fields})
    error = answer["error"]
    missing = fields.get("previous_response_id") == "resp_none"  # (a string: looked up)
    assert status == (404 if missing else 400), error
    assert error["param"] == param and "\n" not in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_the_store_keeps_the_latest_within_its_bounds():
    store = ResponseStore(max_responses=2, max_tokens=100)
    for i in range(3):
        store.put({"id": f"r{i}"}, [], 10)
    assert store.get("r0") is None and store.get("r1") is not None  # (r1 now the latest used)
    store.put({"id": "r3"}, [], 10)
    assert store.get("r2") is None and store.get("r1") is not None
    store.put({"id": "big"}, [], 95)
    assert len(store) == 1 and store.get("big") is not None


def test_the_store_s_bound_counts_what_a_response_echoes(server, monkeypatch):
    """A response's metadata (or user, or text.format) is kept with it: 256 of them of 30 MB
    each held 7 GB, under a bound that counted the conversation's tokens alone."""
    monkeypatch.setattr(server, "responses", ResponseStore(max_tokens=200_000))
    ids = []
    for i in range(3):
        status, answer, _ = call(server, "POST", "/v1/responses", {
            "model": "m", "input": f"hi {i}", "max_output_tokens": 1,
            "metadata": {f"k{j}": "x" * 50_000 for j in range(8)}})
        assert status == 200, answer
        ids.append(answer["id"])
    assert len(server.responses) == 1 and server.responses.get(ids[-1]) is not None


def test_a_stream_left_by_its_client_is_aborted(server, monkeypatch):
    def check(resp) -> None:
        assert resp.status == 200 and resp.readline() == b"event: response.created\n"

    left_and_aborted(server, monkeypatch, "/v1/responses", {"input": "leave", "stream": True},
                     {"Authorization": f"Bearer {KEY}"}, check)


def test_a_failure_is_a_500_or_an_error_event_then_failed(client, server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the engine broke\nsecond line")

    monkeypatch.setattr(Choices, "results", broken)
    monkeypatch.setattr(Choices, "merged", broken)
    status, answer, _ = call(server, "POST", "/v1/responses", {"input": "hi"})
    assert status == 500 and answer["error"]["message"] == "the engine broke"
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error",
                                        "response.failed"]
    assert events[2].message == "the engine broke" and events[3].sequence_number == 3
    assert events[3].response.status == "failed"
    assert events[3].response.error.message == "the engine broke"
