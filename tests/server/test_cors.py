"""A browser page may call the server as vLLM's lets it: a CORS preflight is answered without
the API key, every answer (errors and streams included) names the allowed origin, an origin
left out of `allowed_origins` gets no such header (its preflight a 400, its POST a 403: no
work for a page of another site), and /health
answers probes without the key while every other route still needs it. By default only pages
of this machine are allowed (a site's page could read the cache's `cached_tokens`)."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from statechat.api_cors import LOCAL_ORIGINS, origin_allowed, parse_allowed_origins

from .conftest import KEY

PAGE = "http://localhost:5173"
ASK = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                  "temperature": 0})


def ask(server, method: str, path: str, body: str | None = None, **headers):
    """One request on its own connection: (status, headers, body bytes)."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def preflight(server, origin: str = PAGE, method: str = "POST"):
    return ask(server, "OPTIONS", "/v1/chat/completions", Origin=origin,
               **{"Access-Control-Request-Method": method,
                  "Access-Control-Request-Headers": "authorization, content-type"})


def test_a_preflight_needs_no_key_and_allows_the_api(server):
    status, headers, body = preflight(server)
    assert status == 204 and body == b""
    assert headers["Access-Control-Allow-Origin"] == PAGE and headers["Vary"] == "Origin"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert int(headers["Access-Control-Max-Age"]) > 0


def test_by_default_only_pages_of_this_machine(server):
    assert server.allowed_origins == LOCAL_ORIGINS
    for page in ("http://127.0.0.1:8080", "https://localhost", "http://[::1]:3000",
                 "HTTP://LocalHost:3000"):
        status, headers, _ = preflight(server, origin=page)
        assert status == 204 and headers["Access-Control-Allow-Origin"] == page, page
    for page in ("https://evil.example", "http://localhost.evil.example",
                 "http://localhost:3000.evil.example", "null"):
        status, headers, _ = preflight(server, origin=page)
        assert status == 400 and "Access-Control-Allow-Origin" not in headers, page


def test_a_folded_header_list_is_not_echoed_folded(server):
    host, port = server.server_address[:2]
    raw = (b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: " + PAGE.encode()
           + b"\r\nAccess-Control-Request-Method: POST\r\n"
           + b"Access-Control-Request-Headers: a\r\n X-Evil: 1\r\nConnection: close\r\n\r\n")
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(raw)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n")[0].split(b"\r\n")
    assert b"Access-Control-Allow-Headers: a X-Evil: 1" in head
    assert not any(line.startswith((b" ", b"\t", b"X-Evil")) for line in head)


def test_any_origin_when_asked(server, monkeypatch):
    monkeypatch.setattr(server, "allowed_origins", ("*",))
    status, headers, _ = preflight(server, origin="https://chat.example")
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"


def test_answers_to_a_page_name_its_origin(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    status, headers, body = ask(server, "POST", "/v1/chat/completions", ASK, Origin=PAGE, **auth)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    assert headers["Access-Control-Allow-Origin"] == PAGE
    streamed = json.dumps({**json.loads(ASK), "stream": True})
    status, headers, body = ask(server, "POST", "/v1/chat/completions", streamed, Origin=PAGE,
                                **auth)
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
    assert headers["Access-Control-Allow-Origin"] == PAGE
    # a wrong key's 401 is readable by the page too (it can tell the user why)
    status, headers, _ = ask(server, "GET", "/v1/models", Origin=PAGE, Authorization="Bearer no")
    assert status == 401 and headers["Access-Control-Allow-Origin"] == PAGE
    # no Origin (not a browser): no CORS header
    status, headers, _ = ask(server, "GET", "/v1/models", Authorization=f"Bearer {KEY}")
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_only_the_allowed_origins(server, monkeypatch):
    monkeypatch.setattr(server, "allowed_origins", (PAGE, "https://chat.example"))
    status, headers, _ = preflight(server, origin="https://chat.example")
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://chat.example"
    assert headers["Vary"] == "Origin"
    status, headers, body = preflight(server, origin="https://evil.example")
    assert status == 400 and "Access-Control-Allow-Origin" not in headers
    assert "--allowed-origins" in json.loads(body)["error"]["message"]
    status, headers, _ = ask(server, "GET", "/v1/models", Origin="https://evil.example",
                             Authorization=f"Bearer {KEY}")
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    monkeypatch.setattr(server, "allowed_origins", ())
    assert preflight(server)[0] == 400


def test_a_post_from_an_origin_not_allowed_does_no_work(server, monkeypatch):
    """A page may POST a form or text/plain body with no preflight (the browser then hides
    the answer); from an origin not allowed it is a 403 and nothing is submitted."""
    submitted = []
    monkeypatch.setattr(server.worker, "submit", lambda *a, **k: submitted.append(a))
    monkeypatch.setattr(server, "api_key", None)  # (a page cannot send a key unpreflighted)
    for origin in ("https://evil.example", "null"):
        status, headers, body = ask(server, "POST", "/v1/chat/completions", ASK, Origin=origin,
                                    **{"Content-Type": "text/plain"})
        assert status == 403 and "Access-Control-Allow-Origin" not in headers
        assert json.loads(body)["error"]["code"] == "cors_origin_not_allowed"
    assert submitted == []


def test_a_preflight_for_a_method_not_served_is_refused(server):
    status, _, body = preflight(server, method="DELETE")
    assert status == 400 and "not allowed" in json.loads(body)["error"]["message"]


def test_a_plain_options_is_still_not_a_route(server):
    status, _, body = ask(server, "OPTIONS", "/v1/models", Authorization=f"Bearer {KEY}")
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"


def test_health_answers_probes_without_the_key(server):
    status, _, body = ask(server, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert ask(server, "GET", "/v1/models")[0] == 401
    assert ask(server, "POST", "/v1/chat/completions", ASK)[0] == 401


def test_keep_alive_goes_on_after_a_preflight(server):
    """A preflight and then the request on one connection, as browsers send them."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("OPTIONS", "/v1/chat/completions",
                     headers={"Origin": PAGE, "Access-Control-Request-Method": "POST"})
        first = conn.getresponse()
        first.read()
        conn.request("POST", "/v1/chat/completions", body=ASK,
                     headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}",
                              "Content-Type": "application/json"})
        second = conn.getresponse()
        assert (first.status, second.status) == (204, 200)
        assert json.loads(second.read())["object"] == "chat.completion"
    finally:
        conn.close()


@pytest.mark.parametrize("text, origins", [
    ("*", ("*",)), ("", ()), (" ", ()),
    ("http://localhost:3000, https://chat.example/", ("http://localhost:3000",
                                                      "https://chat.example")),
    ('["http://a.example", "*"]', ("http://a.example", "*")),
    ("HTTPS://Chat.Example:8443, http://localhost:*, null",
     ("https://chat.example:8443", "http://localhost:*", "null")),
])
def test_allowed_origins_are_read(text, origins):
    assert parse_allowed_origins(text) == origins


@pytest.mark.parametrize("text", ["localhost:3000", "http://", "http://a.example/path",
                                  '["http://a.example", 3]', "[not json"])
def test_a_value_that_is_not_an_origin_is_named(text):
    with pytest.raises(ValueError, match="origin"):
        parse_allowed_origins(text)


@pytest.mark.parametrize("origin, allowed", [
    ("http://localhost", True), ("http://localhost:1", True), ("http://localhost:65535", True),
    ("https://localhost:3000", False), ("http://localhost:", False), ("http://localhost:x", False),
    ("http://localhostx:3000", False), ("https://chat.example", True),
    ("https://chat.example:443", False), ("null", False),
])
def test_origins_match_exactly_or_by_a_host_of_any_port(origin, allowed):
    assert origin_allowed(origin, ("http://localhost:*", "https://chat.example")) is allowed
