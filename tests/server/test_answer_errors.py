"""An unexpected failure while a request is answered (a bug, not the client's fault) reaches the
client in OpenAI's error shape with one line of message: a 500 server_error for a whole
response, and, once a stream's headers are sent, an error event followed by `data: [DONE]`.
The server then goes on answering."""

from __future__ import annotations

import http.client
import json

from statechat.api_choices import Choices
from tests.server.conftest import KEY

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def broken(*args, **kwargs):
    raise RuntimeError("the sampler broke\nand a second line the client never sees")


def test_a_failure_of_a_whole_response_is_a_500_of_one_line(server, monkeypatch):
    monkeypatch.setattr(Choices, "results", broken)
    status, body = post(server, BODY)
    error = json.loads(body)["error"]
    assert status == 500 and error["type"] == "server_error"
    assert error["message"] == "the sampler broke"
    monkeypatch.undo()
    status, body = post(server, BODY)  # (the server still answers)
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"


def test_a_failure_in_a_stream_is_an_error_event_then_done(server, monkeypatch):
    monkeypatch.setattr(Choices, "merged", broken)
    status, body = post(server, {**BODY, "stream": True})
    events = [line.removeprefix(b"data: ") for line in body.split(b"\n\n") if line]
    assert status == 200 and events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["message"] == "the sampler broke"
