"""Request bodies sent with `Transfer-Encoding: chunked` (curl -T -, a client streaming its
body) are answered as the same body sent with a Content-Length, chunk extensions and trailers
included, on a connection kept alive for the next request; malformed chunking, a coding other
than chunked, or both framings at once get one clear JSON error, and a chunked body past the
size limit a 413 as soon as it passes it, not after the rest is read."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from statechat import api_http
from tests.server.test_http_details import _read_answer
from tests.serving import KEY

ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY.encode() + b"\r\n")


def chunked(body: bytes, size: int = 7, ext: bytes = b"", trailer: bytes = b"") -> bytes:
    """`body` in chunks of `size` bytes, each size line followed by `ext`, then the last
    (0-size) chunk, the `trailer` lines and the empty line that ends them."""
    parts = [b"%x%s\r\n%s\r\n" % (len(body[i:i + size]), ext, body[i:i + size])
             for i in range(0, len(body), size)]
    return b"".join(parts) + b"0" + ext + b"\r\n" + trailer + b"\r\n"


def ask(conn: socket.socket, data: bytes, head: bytes = HEAD) -> tuple[int, dict, dict]:
    """Send one request on a kept-alive connection; its status, headers and JSON body."""
    conn.sendall(head + data)
    status, headers, body = _read_answer(conn, kept=True)
    return int(status.split()[1]), headers, json.loads(body)


def refused(server, data: bytes, head: bytes = HEAD) -> tuple[int, str]:
    """The status and error message of a request the server answers and then closes."""
    with socket.create_connection(server.server_address[:2], timeout=10) as conn:
        status, headers, body = ask(conn, data, head)
        assert conn.recv(1) == b"" and headers.get("connection") == "close"
    return status, body["error"]["message"]


def test_a_chunked_chat_is_answered_as_one_with_a_content_length(server):
    body = json.dumps(ASK).encode()
    with socket.create_connection(server.server_address[:2], timeout=30) as conn:
        status, _, plain = ask(conn, b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert status == 200
        status, _, streamed = ask(conn, b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body))
    assert status == 200, streamed
    assert streamed["choices"] == plain["choices"] and streamed["usage"] == plain["usage"]


def test_chunk_extensions_and_trailers_are_read_past(server):
    body = json.dumps(ASK).encode()
    data = chunked(body, 5, ext=b" ; name=\"v;x\";flag", trailer=b"X-Sum: 1\r\nX-Two: 2\r\n")
    with socket.create_connection(server.server_address[:2], timeout=30) as conn:
        status, _, answer = ask(conn, b"Transfer-Encoding: chunked\r\n\r\n" + data)
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
        status, _, answer = ask(conn, b"Content-Length: 2\r\n\r\n{}", b"GET /health HTTP/1.1\r\n"
                                b"Host: x\r\n")  # (the trailer was not read as a request)
        assert status == 200 and answer == {"status": "ok"}


def test_a_keep_alive_connection_reads_the_request_after_a_chunked_one(server):
    body = json.dumps(ASK).encode()
    with socket.create_connection(server.server_address[:2], timeout=30) as conn:
        status, _, first = ask(conn, b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, 1))
        status2, _, second = ask(conn, b"Content-Length: %d\r\n\r\n" % len(body) + body)
        status3, _, third = ask(conn, b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body))
    assert (status, status2, status3) == (200, 200, 200)
    assert first["choices"] == second["choices"] == third["choices"]


@pytest.mark.parametrize("data, says", [
    (b"zz\r\n{}\r\n0\r\n\r\n", "chunk size"),
    (b"0x2\r\n{}\r\n0\r\n\r\n", "chunk size"),
    (b"+2\r\n{}\r\n0\r\n\r\n", "chunk size"),
    (b"\r\n{}\r\n0\r\n\r\n", "chunk size"),
    (b"2\r\n{}XX0\r\n\r\n", "CRLF"),
    (b"2\n{}\n0\n\n", "CRLF"),
    (b"5\r\n{}", "ended"),
    (b"2\r\n{}\r\n", "ended"),
    (b"2\r\n{}\r\n0\r\nX-Sum: 1\r\n", "ended"),
], ids=["not-hex", "0x", "sign", "empty", "no-crlf", "bare-lf", "cut-in-data", "no-last-chunk",
        "cut-in-trailer"])
def test_malformed_chunking_is_a_400_saying_what(server, data, says):
    with socket.create_connection(server.server_address[:2], timeout=10) as conn:
        conn.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + data)
        conn.shutdown(socket.SHUT_WR)  # (a body cut short: the client sends no more)
        status, headers, body = _read_answer(conn)
    error = json.loads(body)["error"]
    assert b" 400 " in status and says in error["message"], error
    assert "\n" not in error["message"] and error["type"] == "invalid_request_error"
    assert headers.get("connection") == "close"


@pytest.mark.parametrize("header, status, says", [
    (b"Transfer-Encoding: gzip\r\n", 501, "gzip"),
    (b"Transfer-Encoding: gzip, chunked\r\n", 501, "gzip"),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n", 400, "both"),
    (b"Transfer-Encoding: chunked, chunked\r\n", 400, "once"),
], ids=["gzip", "gzip-chunked", "with-content-length", "twice"])
def test_a_framing_the_server_does_not_take_is_refused_saying_so(server, header, status, says):
    got, message = refused(server, header + b"\r\n" + chunked(b"{}"))
    assert got == status and says in message, message


def test_transfer_encoding_on_an_http_1_0_request_is_refused(server):
    """HTTP/1.0 has no chunked coding (RFC 9112 6.1: its framing is to be taken as faulty)."""
    head = HEAD.replace(b"HTTP/1.1", b"HTTP/1.0")
    got, message = refused(server, b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b"{}"), head)
    assert got == 400 and "HTTP/1.1" in message


def test_a_chunked_body_over_the_limit_is_a_413_before_the_rest_comes(server, monkeypatch):
    """A chunk that says it holds more than the limit is refused on its size line, with the
    connection closed (its data is not read); small chunks past the limit are a 413 too, read
    (and dropped) to their end so that the connection goes on."""
    with socket.create_connection(server.server_address[:2], timeout=10) as conn:
        start = time.monotonic()
        conn.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n7fffffff\r\n{\"messages")
        status, _, body = _read_answer(conn)  # (the rest never comes)
        assert time.monotonic() - start < 5 and b" 413 " in status
        assert "MiB" in json.loads(body)["error"]["message"]
    monkeypatch.setattr(api_http, "MAX_BODY_BYTES", 1000)
    monkeypatch.setattr(api_http, "DRAIN_BYTES", 4000)
    ask_long = json.dumps({**ASK, "messages": [{"role": "user", "content": "x" * 2000}]})
    with socket.create_connection(server.server_address[:2], timeout=10) as conn:
        data = b"Transfer-Encoding: chunked\r\n\r\n" + chunked(ask_long.encode(), 100)
        status, _, answer = ask(conn, data)
        assert status == 413 and answer["error"]["type"] == "invalid_request_error"
        status, _, answer = ask(conn, b"\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert status == 200 and answer == {"status": "ok"}


def test_http_client_streaming_its_body_in_chunks(server):
    """A client library's chunked upload (http.client's encode_chunked, as curl -T - or a
    Node stream sends it), two on one connection."""
    body = json.dumps(ASK).encode()
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    try:
        answers = []
        for _ in range(2):
            pieces = (body[i:i + 9] for i in range(0, len(body), 9))  # (a generator)
            conn.request("POST", "/v1/chat/completions", pieces, headers=headers,
                         encode_chunked=True)
            resp = conn.getresponse()
            answers.append((resp.status, json.loads(resp.read())))
    finally:
        conn.close()
    assert [status for status, _ in answers] == [200, 200]
    assert answers[0][1]["choices"] == answers[1][1]["choices"]
