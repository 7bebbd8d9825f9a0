"""Anthropic's Messages API on `statechat serve` (POST /v1/messages, /v1/messages/count_tokens),
over raw HTTP on the embedded tiny model: a reply in Anthropic's shape; `system` as a string or
as text blocks renders the prompt the chat API renders; a stream's events come in Anthropic's
order and its text deltas join to the whole reply's text; max_tokens and stop_sequences end a
reply with their stop_reason; a repeated conversation reports the engine's own reuse as
cache_read_input_tokens (input_tokens the rest); count_tokens counts the prompt a request has; a
last assistant message is continued; errors (a missing max_tokens, an image block, a metadata of
the wrong type, a wrong key, an unknown route method) have Anthropic's shape; the key is taken
from x-api-key; a client that leaves, streamed or not, has its request aborted (structured
outputs: test_anthropic_structured.py)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.server.conftest import KEY, left_and_aborted

WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel"]
ASK = {"model": "claude-any", "max_tokens": 8, "temperature": 0,
       "messages": [{"role": "user", "content": "Tell me about caches."}]}


def call(server, body, path: str = "/v1/messages", headers: dict | None = None,
         method: str = "POST"):
    """(status, the JSON answer), or for a stream (status, [(event, data)])."""
    heads = {"Content-Type": "application/json", "x-api-key": KEY,
             "anthropic-version": "2023-06-01", **(headers or {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers=heads, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not (body or {}).get("stream"):
        return status, json.loads(text)
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[7:], json.loads(data[6:])))
        assert events[-1][1]["type"] == events[-1][0]
    return status, events


def text_of(reply: dict) -> str:
    return "".join(b["text"] for b in reply["content"] if b["type"] == "text")


def long_chat(n: int = 150) -> list[dict]:
    text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n))
    return [{"role": "user", "content": text}]


def test_a_message_in_anthropics_shape(server):
    status, reply = call(server, ASK)
    assert status == 200
    assert reply["id"].startswith("msg_") and reply["type"] == "message"
    assert reply["role"] == "assistant" and reply["model"] == "tiny-qwen3.5"
    assert [b["type"] for b in reply["content"]] == ["text"] and text_of(reply)
    assert reply["stop_reason"] in ("end_turn", "max_tokens")
    assert reply["stop_sequence"] is None
    usage = reply["usage"]
    assert 1 <= usage["output_tokens"] <= 8 and usage["input_tokens"] > 0
    assert usage["cache_creation_input_tokens"] == 0


def test_system_as_a_string_or_blocks_is_the_chats_system_message(server):
    _, chat_reply = call(server, {"model": "m", "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "system", "content": "You are terse."}, *ASK["messages"]]},
        "/v1/chat/completions")
    as_string = call(server, {**ASK, "max_tokens": 6, "system": "You are terse."})[1]
    as_blocks = call(server, {**ASK, "max_tokens": 6, "system": [
        {"type": "text", "text": "You are "}, {"type": "text", "text": "terse.",
                                               "cache_control": {"type": "ephemeral"}}]})[1]
    assert text_of(as_string) == text_of(as_blocks) == chat_reply["choices"][0]["message"][
        "content"]
    count = call(server, {**ASK, "system": "You are terse."}, "/v1/messages/count_tokens")[1]
    assert count["input_tokens"] == chat_reply["usage"]["prompt_tokens"]


def test_a_streams_events_come_in_order_and_join_to_the_whole_text(server):
    body = {**ASK, "max_tokens": 12, "temperature": 0.8, "seed": 7}
    whole = call(server, body)[1]
    status, events = call(server, {**body, "stream": True})
    assert status == 200
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["id"].startswith("msg_") and start["usage"]["output_tokens"] == 0
    assert events[1][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == text_of(whole)
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert end["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_max_tokens_ends_the_reply_with_stop_reason_max_tokens(server):
    reply = call(server, {**ASK, "max_tokens": 3, "messages": long_chat(20)})[1]
    assert reply["stop_reason"] == "max_tokens" and reply["usage"]["output_tokens"] == 3


def test_a_stop_sequence_ends_the_reply_and_is_named(server):
    body = {**ASK, "max_tokens": 24, "messages": long_chat(30)}
    text = text_of(call(server, body)[1])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"no stop to pick in {text!r}"
    for stream in (False, True):
        got = call(server, {**body, "stop_sequences": ["@@never@@", stop], "stream": stream})[1]
        if stream:
            joined = "".join(d["delta"]["text"] for n, d in got if n == "content_block_delta")
            assert got[-2][1]["delta"] == {"stop_reason": "stop_sequence",
                                           "stop_sequence": stop}
            assert joined == text[:text.index(stop)]
        else:
            assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", stop)
            assert text_of(got) == text[:text.index(stop)]


def reused_by(server, send) -> tuple[object, int]:
    """`send()`'s answer and the prompt tokens the engine reused for it, as /metrics counts
    them (the server counts a request once its answer is sent: waited for, so a request sent
    through here is counted before the next one's count is read)."""
    metrics = server.metrics
    prompt_tokens, cached_tokens = metrics.prompt_tokens, metrics.cached_tokens
    answer = send()
    deadline = time.monotonic() + 10
    while metrics.prompt_tokens == prompt_tokens and time.monotonic() < deadline:
        time.sleep(0.01)
    return answer, metrics.cached_tokens - cached_tokens


def test_a_repeated_conversation_reports_the_engines_reuse(server):
    body = {**ASK, "max_tokens": 2, "messages": long_chat(200)}
    first = reused_by(server, lambda: call(server, body))[0][1]["usage"]
    (_, again), reused = reused_by(server, lambda: call(server, body))
    again = again["usage"]
    assert again["cache_read_input_tokens"] == reused > 0
    assert again["input_tokens"] + reused == first["input_tokens"] + first[
        "cache_read_input_tokens"]
    count = call(server, body, "/v1/messages/count_tokens")[1]
    assert count == {"input_tokens": again["input_tokens"] + reused}
    (_, events), reused = reused_by(server, lambda: call(server, {**body, "stream": True}))
    for usage in (events[0][1]["message"]["usage"], events[-2][1]["usage"]):
        assert usage["cache_read_input_tokens"] == reused > 0
        assert usage["input_tokens"] == count["input_tokens"] - reused


def test_count_tokens_needs_no_max_tokens_and_counts_the_prompt(server):
    body = {k: v for k, v in ASK.items() if k != "max_tokens"}
    status, count = call(server, body, "/v1/messages/count_tokens")
    fresh = {**ASK, "messages": [{"role": "user", "content": "A fresh question, never sent."}]}
    usage = call(server, fresh)[1]["usage"]
    counted = call(server, fresh, "/v1/messages/count_tokens")[1]["input_tokens"]
    assert status == 200 and count["input_tokens"] > 0
    assert counted == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_a_last_assistant_message_is_continued(server):
    messages = [*ASK["messages"], {"role": "assistant", "content": "Caches are"}]
    reply = call(server, {**ASK, "messages": messages})[1]
    chat = call(server, {"messages": messages, "max_tokens": 8, "temperature": 0,
                         "continue_final_message": True, "add_generation_prompt": False},
                "/v1/chat/completions")[1]
    assert text_of(reply) == chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, status, kind, says", [
    ({k: v for k, v in ASK.items() if k != "max_tokens"}, 400, "invalid_request_error",
     "max_tokens is required"),
    ({**ASK, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     400, "invalid_request_error", "messages[0].content[1]: image blocks are not supported"),
    ({**ASK, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
     "messages[0].role must be user or assistant"),
    ({**ASK, "stop_sequences": "END"}, 400, "invalid_request_error", "stop_sequences"),
    ({**ASK, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error", "--tool-call-parser"),
    ({**ASK, "max_tokens": 5000}, 400, "invalid_request_error", "max_tokens is too large"),
    ({**ASK, "metadata": "me"}, 400, "invalid_request_error", "metadata must be an object"),
    ({**ASK, "metadata": {"user_id": 7}}, 400, "invalid_request_error",
     "metadata.user_id must be a string"),
])
def test_errors_have_anthropics_shape(server, body, status, kind, says):
    got_status, error = call(server, body)
    assert got_status == status
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert says in error["error"]["message"] and set(error) == {"type", "error"}
    assert "leave max_tokens out" not in error["error"]["message"]  # (it is required here)


def test_the_key_is_taken_from_x_api_key_and_a_wrong_one_is_anthropics_401(server):
    assert call(server, ASK, headers={"x-api-key": "wrong"})[0] == 401
    status, error = call(server, ASK, headers={"x-api-key": "wrong"})
    assert error["error"]["type"] == "authentication_error" and "x-api-key" in error[
        "error"]["message"]
    status, reply = call(server, ASK, headers={"x-api-key": "", "Authorization": f"Bearer {KEY}"})
    assert status == 200 and reply["type"] == "message"
    models = call(server, None, "/v1/models", method="GET")  # (the key: any route)
    assert models[0] == 200
    openai_401 = call(server, None, "/v1/models", {"x-api-key": "wrong"}, method="GET")[1]
    assert openai_401["error"]["type"] == "authentication_error" and "code" in openai_401["error"]


def test_a_get_is_a_405_in_anthropics_shape(server):
    status, error = call(server, None, "/v1/messages", method="GET")
    assert status == 405 and error["type"] == "error"
    assert "/v1/messages/count_tokens" in error["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_has_its_request_aborted(server, monkeypatch, stream):
    """The engine's steps wait until the request is aborted: the server notices the client
    left while the prompt is computed (a stream's headers are out; no event yet)."""
    def check(resp) -> None:
        assert resp.status == 200

    left_and_aborted(server, monkeypatch, "/v1/messages", {**ASK, "stream": stream},
                     {"x-api-key": KEY}, check if stream else None)
