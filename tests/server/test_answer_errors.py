"""An unexpected failure while a request is answered (a bug, not the client's fault) reaches the
client in OpenAI's error shape with one line of message: a 500 server_error for a whole
response, and, once a stream's headers are sent, an error event followed by `data: [DONE]`.
A failure before the answer is a 500 too; values nested past Python's stack are answered. The
server then goes on answering."""

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


def test_a_failure_before_the_answer_is_a_500_of_one_line(server, monkeypatch):
    """(A route's unexpected error before its answer, such as in rendering, dropped the
    connection unanswered.)"""
    monkeypatch.setattr(server.worker, "render", broken)
    status, body = post(server, BODY)
    assert status == 500 and json.loads(body)["error"] == {
        "message": "the sampler broke", "type": "server_error", "param": None, "code": None}
    monkeypatch.undo()
    assert post(server, BODY)[0] == 200  # (the server still answers)


def test_deeply_nested_template_variables_are_answered(server):
    """(Nested 500 deep, counting their characters overflowed Python's stack before the
    template saw them: no answer at all.) The template then renders them (Python 3.12) or
    refuses them in one line (3.11: its own stack overflows)."""
    deep: list = ["x"]
    for _ in range(500):
        deep = [deep]
    status, body = post(server, {**BODY, "chat_template_kwargs": {"deep": deep}})
    if status == 200:
        assert json.loads(body)["choices"][0]["finish_reason"] == "length"
    else:
        error = json.loads(body)["error"]
        assert status == 400 and error["type"] == "invalid_request_error"
        assert "\n" not in error["message"] and "chat template" in error["message"]
    assert post(server, BODY)[0] == 200
