"""The HTTP side of the API server (server.py): requests on keep-alive connections, bodies
(with a Content-Length or chunked: api_body) read with a bound (a refused one drained, so the
client reads the answer), JSON answers, and every error in OpenAI's shape, http.server's own
included, and a closed connection noticed while its answer is made (`_gone`). The server
tracks which connections are idle (`connection_state`), so that a stop can close them.
Browsers' CORS as vLLM's server answers it: every answer to an allowed `Origin` says so,
and a preflight (OPTIONS with `Access-Control-Request-Method`) is answered without the API key."""

from __future__ import annotations

import hmac
import json
import selectors
import socket
import sys
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

from statechat.api_body import BodyTooLarge, ChunkedBody, ChunkError, framing_error
from statechat.api_cors import CORS_MAX_AGE_S, CORS_METHODS, origin_allowed
from statechat.api_request import ApiError

MAX_BODY_BYTES = 32 << 20
DRAIN_BYTES = 4 * MAX_BODY_BYTES  # a refused body read (and dropped) so the client gets the answer
SOCKET_TIMEOUT_S = 300  # a connection that sends or reads nothing for this long is closed
MAX_BLANK_BYTES = 64  # CR and LF bytes skipped before a request line (RFC 9112 2.2 asks for one
# empty line: a body's stray CRLF); past them, what comes is read as the request line
# C0, DEL and C1 control characters as `\xNN` in a log line (backslashes are left as they are:
# api_request.named has escaped a field's name already)
CONTROL_CHARS = str.maketrans({c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))})


class JsonHandler(BaseHTTPRequestHandler):
    """A handler whose routes raise ApiError for their errors (`_guard` answers them). Its
    server has `api_key`, `allowed_origins` (parse_allowed_origins'), `quiet` and
    `connection_state(handler, busy)`; a subclass says which methods it serves in
    `_methods_message` and `_allow`."""

    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self.server.connection_state(self, busy=False)

    def parse_request(self) -> bool:
        self.server.connection_state(self, busy=True)  # (its request line has come)
        return super().parse_request()

    def handle_one_request(self) -> None:
        try:
            self._skip_empty_lines()
            if self._refused_as_not_http():
                return
            super().handle_one_request()
        except (ConnectionError, TimeoutError):  # the client went (or stalled) mid-request:
            self.close_connection = True  # no one to answer, and no traceback for the log
        finally:
            self.server.connection_state(self, busy=False)

    def _skip_empty_lines(self) -> None:
        """Skip the empty lines before a request line (up to MAX_BLANK_BYTES of CR and LF), as
        HTTP asks of a server: a client whose body ends with a CRLF its Content-Length leaves
        out sends one before its next request, which http.server read as an empty request
        line, closing the connection unanswered. (Blocks as the request line's read would.)"""
        for _ in range(MAX_BLANK_BYTES):
            if self.rfile.peek(1)[:1] not in (b"\r", b"\n"):  # (b"": closed)
                return
            self.rfile.read(1)

    def _refused_as_not_http(self) -> bool:
        """Whether the next bytes cannot begin a request line (neither printable ASCII nor
        white space: a TLS handshake, a client told https://) and got a 400 (then a close),
        where http.server waited for a newline as the client for an answer, SOCKET_TIMEOUT_S."""
        first = self.rfile.peek(1)[:1]  # (blocks as the request line's read would; b"": closed)
        if not first or first.isspace() or 0x20 < first[0] < 0x7F:
            return False
        self.rfile.read1(1 << 16)  # (what came with it: an unread rest would reset the answer)
        self.command = self.headers = None  # (none of an earlier request on this connection)
        self.requestline, self.request_version = "", self.default_request_version
        self.send_error(400, "this looks like a TLS handshake: this server speaks plain HTTP, "
                        "use an http:// URL" if first == b"\x16" else "not an HTTP request line")
        return True

    def finish(self) -> None:
        self.server.connection_state(self, busy=None)
        super().finish()

    def log_message(self, format: str, *args) -> None:
        """A log line, its control characters escaped (`\\x1b`) as http.server's own log
        escapes them: a request line is the client's, and its escape sequences would otherwise
        reach the terminal that runs the server."""
        if not self.server.quiet:
            message = (format % args).translate(CONTROL_CHARS)
            sys.stderr.write(f"{self.address_string()} {message}\n")

    def end_headers(self) -> None:
        origin = self._allowed_origin()
        if origin:
            self.send_header("Access-Control-Allow-Origin", origin)
            if origin != "*":
                self.send_header("Vary", "Origin")
        if self.request_version == "HTTP/1.0" and not self.close_connection:
            # (an HTTP/1.0 client that asked for keep-alive keeps the connection only when told
            # so; untold, it waited for a close, as the server for its next request)
            self.send_header("Connection", "keep-alive")
        self._headers_sent = True
        super().end_headers()

    def _allowed_origin(self) -> str | None:
        """The Access-Control-Allow-Origin for this request's Origin: "*" when any is allowed,
        the origin itself when it is one of those allowed, else None (no header: the browser
        then keeps the answer from its page)."""
        headers = getattr(self, "headers", None)  # (none on a request line it could not parse)
        origin = headers.get("Origin") if headers is not None else None
        allowed = self.server.allowed_origins
        if not origin:
            return None
        return "*" if "*" in allowed else origin if origin_allowed(origin, allowed) else None

    def _preflight(self) -> bool:
        """Answer a browser's CORS preflight (no API key: browsers send none with it) and say
        whether this OPTIONS was one. An origin or method not allowed is a 400, as
        Starlette's (vLLM's) answers it."""
        method = self.headers.get("Access-Control-Request-Method")
        if not (self.headers.get("Origin") and method):
            return False
        self._body_read = False
        if not self._allowed_origin():
            error = ApiError(400, "this origin is not allowed: serve with --allowed-origins "
                             "naming it", code="cors_origin_not_allowed")
        elif method.strip().upper() not in CORS_METHODS.split(", "):
            error = ApiError(400, f"method {method} is not allowed: {CORS_METHODS}",
                             code="cors_method_not_allowed")
        else:
            self._drain()
            self.send_response(204)
            self.send_header("Access-Control-Allow-Methods", CORS_METHODS)
            if requested := self.headers.get("Access-Control-Request-Headers"):  # (unfolded)
                self.send_header("Access-Control-Allow-Headers", " ".join(requested.split()))
            self.send_header("Access-Control-Max-Age", str(CORS_MAX_AGE_S))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        self._drain()
        self._send_json(error.status, error.body())
        return True

    def _send_json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a malformed request line or header, a method it has no
        handler for) in OpenAI's shape, as every other error; the connection then closes."""
        self.close_connection = True
        self.request_version = self.protocol_version  # (an unparsed line reads as HTTP/0.9,
        # which gets no status line or headers)
        headers = {}
        if code == HTTPStatus.NOT_IMPLEMENTED and self.command:  # (an unknown method)
            code, message = HTTPStatus.METHOD_NOT_ALLOWED, self._methods_message()
            headers = self._allow()
        kind = "server_error" if code >= 500 else "invalid_request_error"
        error = "method_not_allowed" if code == HTTPStatus.METHOD_NOT_ALLOWED else None
        self._send_json(code, ApiError(code, message or HTTPStatus(code).phrase, code=error,
                                       kind=kind).body(), headers)

    def _guard(self, route, is_open: bool = False) -> None:
        """Run `route`, answering its ApiError; with an API key, only an `is_open` route
        (/health, for probes, as vLLM leaves it) is served without it. A POST from a browser
        page of an origin not allowed is a 403 before any work: a page may send a form or
        text/plain POST with no preflight, and without this any site's page could have the
        server generate (and fill its cache) though the browser keeps the answer from it."""
        self._body_read = False  # per request: a keep-alive connection carries several
        self._headers_sent = False
        try:
            if self.command == "POST" and self.headers.get("Origin") \
                    and not self._allowed_origin():
                raise ApiError(403, "this origin is not allowed: serve with --allowed-origins "
                               "naming it", code="cors_origin_not_allowed")
            if self.server.api_key and not is_open and not self._authorized():
                raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' "
                               "(or 'x-api-key: KEY')", code="invalid_api_key",
                               kind="authentication_error")
            route()
        except ApiError as e:
            self._drain()
            self._send_json(e.status, self._error_body(e), e.headers)
        except (ConnectionError, TimeoutError):  # (the client went: handle_one_request's)
            raise
        except Exception as e:  # noqa: BLE001 - a bug: answered in one line, the trace logged
            self._unexpected(e)
        else:
            self._drain()  # (a body its route did not read, a GET's: not the next request)

    def _unexpected(self, e: Exception) -> None:
        """A route's unexpected failure (a bug, not the client's fault): its traceback to the
        log, a 500 of one line to the client where no answer has begun (else the connection
        is closed: its answer cannot be whole)."""
        sys.stderr.write("".join(traceback.format_exception(e)))
        self.close_connection = True
        if not self._headers_sent:
            error = ApiError.internal(e)
            self._send_json(error.status, self._error_body(error), error.headers)

    def _authorized(self) -> bool:
        """Whether the request carries the API key: `Authorization: Bearer KEY` (OpenAI's
        clients) or `x-api-key: KEY` (Anthropic's)."""
        scheme, _, key = self.headers.get("Authorization", "").partition(" ")
        expected = self.server.api_key.encode()
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), expected):
            return True
        given = self.headers.get("x-api-key")
        return given is not None and hmac.compare_digest(given.strip().encode(), expected)

    def _error_body(self, error: ApiError) -> dict:
        """The body of an error's answer: OpenAI's shape (a route may answer in its API's)."""
        return error.body()

    def _framing(self) -> int | ChunkedBody:
        """How the body comes: its Content-Length (0 without one), or a ChunkedBody to read it
        by. Raises framing_error's ApiError, the body left unread and the connection closed."""
        if error := framing_error(self.headers, self.request_version):
            self._body_read = self.close_connection = True
            raise error
        if "Transfer-Encoding" in self.headers:
            return ChunkedBody(self.rfile)
        return int(self.headers.get("Content-Length") or "0")

    def _drain(self) -> None:
        """Read an unread request body so the connection stays usable, and so that a client
        still sending one too large reads the 413 (closed on it, it met a broken pipe). Past
        DRAIN_BYTES (or a malformed chunk) the connection is closed unread."""
        if self._body_read:
            return
        try:
            n = self._framing()
        except ApiError:
            return  # (not read: the connection closes)
        self._body_read = True
        if isinstance(n, ChunkedBody):
            self._drop_chunks(n)
        elif 0 < n <= DRAIN_BYTES:
            while n > 0 and (chunk := self.rfile.read(min(n, 1 << 20))):
                n -= len(chunk)
            self.close_connection = self.close_connection or n > 0
        elif n:
            self.close_connection = True

    def _drop_chunks(self, chunks: ChunkedBody) -> None:
        """Read a chunked body's rest and drop it, up to DRAIN_BYTES in all, else close."""
        try:
            chunks.read(DRAIN_BYTES, keep=False)
        except (ChunkError, BodyTooLarge):
            self.close_connection = True

    def _body(self) -> dict:
        n = self._framing()
        too_large = ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        if isinstance(n, ChunkedBody):
            try:
                raw = n.read(MAX_BODY_BYTES)
            except ChunkError as e:
                self.close_connection = True
                raise ApiError(400, str(e)) from None
            except BodyTooLarge:
                self._drop_chunks(n)  # (the client reads the 413; past DRAIN_BYTES, closed)
                raise too_large from None
            finally:
                self._body_read = True
        elif n > MAX_BODY_BYTES:
            raise too_large  # (_guard's _drain reads it)
        else:
            raw = self.rfile.read(n)
            self._body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # (an int of over 4300 digits is a ValueError)
            raise ApiError(400, f"the request body is not valid JSON ({str(e)[:200]})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _methods_message(self) -> str:
        return f"method {self.command} is not supported here"

    def _allow(self) -> dict[str, str]:
        """The Allow header of a 405 (HTTP requires one): the methods its route takes."""
        return {}

    def _gone(self) -> bool:
        """Whether the client closed its connection while it waits for the answer (it sends
        nothing more then, so a readable socket with no data is a closed one)."""
        try:
            with selectors.DefaultSelector() as ready:  # (select.select stops at fd 1024)
                ready.register(self.connection, selectors.EVENT_READ)
                if not ready.select(0):
                    return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except ConnectionError:
            return True
        except (OSError, ValueError):  # (not a sign the client left)
            return False
