"""HTTP details a client relies on: an HTTP/1.0 client that asks for keep-alive is told it got
it (else it waits for a close that never comes), a 405 says which methods its route takes (the
Allow header HTTP requires), a request line in absolute form (`POST http://host/v1/...`,
as a client sends it to a proxy) reaches its route, and empty lines before a request line
(a body's stray CRLF on a keep-alive connection) are skipped, as HTTP asks, not read as a
request line that ends the connection unanswered."""

from __future__ import annotations

import json
import socket

from tests.serving import KEY

AUTH = f"Authorization: Bearer {KEY}\r\n".encode()


def _read_answer(conn: socket.socket, kept: bool = False) -> tuple[bytes, dict[str, str], bytes]:
    """One answer read off `conn` as an HTTP/1.0 client reads it: to its Content-Length when
    the server said `Connection: keep-alive` (or, `kept`, on an HTTP/1.1 connection kept
    alive), else to the connection's close."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, "the connection closed before the answer's head"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    if kept or headers.get("connection", "").lower() == "keep-alive":
        while len(body) < int(headers["content-length"]):
            body += conn.recv(65536)
    else:
        while chunk := conn.recv(65536):  # (a timeout here: the server kept it open, unsaid)
            body += chunk
    return status.encode(), headers, body


def test_an_http_1_0_keep_alive_client_is_not_left_waiting(server):
    """`ab -k` and other HTTP/1.0 clients keep a connection only when the answer says
    `Connection: keep-alive`; the server kept theirs open without saying so, and the client
    waited for the close (300 s, the idle timeout) to know the answer had ended."""
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=5) as conn:
        for _ in range(2):
            conn.sendall(b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n" + AUTH
                         + b"\r\n")
            status, headers, body = _read_answer(conn)
            assert b" 200 " in status and json.loads(body)["object"] == "list"
            if headers.get("connection", "").lower() != "keep-alive":
                break  # (closed: the client knew the answer had ended)


def test_a_405_names_the_methods_its_route_takes(server):
    host, port = server.server_address[:2]
    for line, allowed in [(b"POST /v1/models", "GET, HEAD"), (b"GET /v1/chat/completions", "POST"),
                          (b"DELETE /health", "GET, HEAD"), (b"FOO /v1/completions", "POST")]:
        with socket.create_connection((host, port), timeout=5) as conn:
            conn.sendall(line + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + AUTH + b"\r\n")
            status, headers, body = _read_answer(conn)
        assert b" 405 " in status, line
        assert headers.get("allow") == allowed, (line, headers)
        assert json.loads(body)["error"]["code"] == "method_not_allowed"


def test_a_request_line_in_absolute_form_reaches_its_route(server):
    """HTTP/1.1 servers must take `METHOD http://host/path` (RFC 9112, 3.2.2); it was a 404
    naming the whole URL."""
    host, port = server.server_address[:2]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(b"POST http://%s:%d/v1/chat/completions?x=1 HTTP/1.1\r\nHost: x\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n" % (host.encode(), port,
                                                                       len(body))
                     + AUTH + b"\r\n" + body)
        status, _, answer = _read_answer(conn)
    assert b" 200 " in status, answer
    assert json.loads(answer)["usage"]["completion_tokens"] == 2


def test_a_bad_content_length_is_named_as_such(server):
    """A Content-Length that is no count of bytes was told "not in chunks", as a chunked body
    was: the 400 now says what is wrong with each (a chunked body is read: test_chunked.py;
    with a Content-Length besides, it is refused)."""
    host, port = server.server_address[:2]
    count = "Content-Length must be a count of bytes, got "
    for header, says in [(b"Content-Length: -1", count + "'-1'"),
                         (b"Content-Length: 1.5", count + "'1.5'"),
                         (b"Content-Length: 2\r\nContent-Length: 3", "Content-Lengths disagree"),
                         (b"Transfer-Encoding: chunked\r\nContent-Length: 2",
                          "both Transfer-Encoding and Content-Length")]:
        with socket.create_connection((host, port), timeout=5) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n"
                         + AUTH + b"\r\n{}")
            status, _, body = _read_answer(conn)
        assert b" 400 " in status, header
        assert says in json.loads(body)["error"]["message"], (header, body)


def test_empty_lines_before_a_request_line_are_skipped(server):
    """A client that ends its body with a CRLF its Content-Length does not count leaves an
    empty line before its next request on the connection (RFC 9112 2.2: a server ignores
    it); that request was read as an empty request line, and the connection closed without
    an answer, as was a request sent after an empty line on a new connection."""
    host, port = server.server_address[:2]
    body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(post + b"\r\n")  # (the stray CRLF)
        status, _, answer = _read_answer(conn, kept=True)
        assert b" 200 " in status and json.loads(answer)["choices"]
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, answer = _read_answer(conn, kept=True)
        assert b" 200 " in status and json.loads(answer) == {"status": "ok"}
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(b"\r\n\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _, answer = _read_answer(conn)
        assert b" 200 " in status and json.loads(answer) == {"status": "ok"}
