"""Clients that go away at awkward moments: one that resets its connection before its request
body is whole (or while a refused body is drained) costs the server no traceback in its log,
and the server goes on serving; one that leaves a stream before its first token (its prompt
still being computed) gets its request aborted then, not once the prompt is done."""

from __future__ import annotations

import socket
import struct
import threading
import urllib.request

import pytest

from tests.server.conftest import KEY, left_and_aborted

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" % (
    KEY.encode())


def errors_while(server, monkeypatch, data: bytes) -> list:
    """The errors the server's handle_error was given (socketserver prints each with its
    traceback) while it served a connection that sent `data`, then reset (SO_LINGER 0)."""
    errors, done = [], threading.Event()
    monkeypatch.setattr(server, "handle_error", lambda *args: errors.append(args))
    close = server.shutdown_request

    def closed(request) -> None:
        close(request)
        done.set()

    monkeypatch.setattr(server, "shutdown_request", closed)
    conn = socket.create_connection(server.server_address[:2], timeout=30)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.sendall(data)
    conn.close()
    assert done.wait(30)
    return errors


@pytest.mark.parametrize("length", [100, 40 << 20], ids=["short-body", "drained-413"])
def test_a_client_that_resets_leaves_no_traceback(server, monkeypatch, length):
    data = HEAD + b"Content-Length: %d\r\n\r\n{\"messages\"" % length
    assert errors_while(server, monkeypatch, data) == []
    req = urllib.request.Request(f"{server.url}/health", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def test_a_stream_left_before_its_first_token_is_aborted(server, monkeypatch):
    """The engine's steps wait (a long prompt's chunks, which give the stream no event) until
    the request is aborted: the server notices the client left without a token to write."""
    def check(resp) -> None:
        assert resp.status == 200 and resp.readline().startswith(b"data: ")  # (the role chunk)

    body = {"messages": [{"role": "user", "content": "leave during the prompt"}], "stream": True}
    left_and_aborted(server, monkeypatch, "/v1/chat/completions", body,
                     {"Authorization": f"Bearer {KEY}"}, check)
