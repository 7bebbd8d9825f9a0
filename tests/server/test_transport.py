"""Bytes on a connection that are not an HTTP request as a client meant it: a TLS handshake (a
client told https:// for this plain-http server) is answered with a 400 at once and the
connection closed, not held until the idle timeout (300 s) while both sides wait; a body whose
Content-Length headers disagree is a 400, not read by the first of them."""

from __future__ import annotations

import json
import socket
import time

from tests.server.conftest import KEY

# the first bytes of a TLS 1.2 ClientHello: a handshake record, then random bytes with no newline
CLIENT_HELLO = bytes.fromhex("160301020001000200fc0303") + bytes(range(1, 10)) * 40


def answer_to(server, data: bytes, timeout: float = 10) -> bytes:
    """What the server sends back to `data` (the client keeps its side open, as a TLS client
    waiting for the server's hello does) until it closes the connection."""
    with socket.create_connection(server.server_address[:2], timeout=timeout) as conn:
        conn.sendall(data)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
    return out


def test_a_tls_handshake_gets_a_400_at_once(server):
    start = time.monotonic()
    answer = answer_to(server, CLIENT_HELLO)  # (a hang: a TimeoutError after 10 s)
    assert time.monotonic() - start < 5
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    error = json.loads(body)["error"]
    assert "http://" in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_content_lengths_that_disagree_are_a_400(server):
    """Two Content-Length headers of different values leave the body's end unknown (RFC 9112
    6.3: a 400, and the connection closed); the same value twice is taken."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode() + b"\r\nConnection: close\r\n"
            + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n")
    answer = answer_to(server, head % (len(body), 3) + body)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 400 ")
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert "Content-Length" in error["message"]
    assert answer_to(server, head % (len(body), len(body)) + body).startswith(b"HTTP/1.1 200 ")
