"""How a request's body is framed (RFC 9112 6): its Content-Length, or HTTP/1.1's chunked
transfer coding (7.1), which curl -T -, Node's fetch of a stream or httpx with a generator
send. `framing_error` names what keeps a body's end from being known; `ChunkedBody` reads a
chunked body chunk by chunk, under a bound on its decoded size, refusing one past the bound
on the size line of the chunk that passes it (that chunk's data is not read).

A request with both Transfer-Encoding and Content-Length is refused (RFC 9112 6.3 lets a
server refuse it or take the Transfer-Encoding alone; refusing leaves no doubt about where
the body ends, which is what request smuggling plays on). So is a coding other than chunked
(501: none is decoded), chunked twice or not last (400), and Transfer-Encoding on an HTTP/1.0
request (6.1: its framing is faulty)."""

from __future__ import annotations

from email.message import Message
from string import hexdigits

from statechat.api_request import ApiError

MAX_LINE_BYTES = 4096  # a chunk's size line (its extensions included) or a trailer line
MAX_TRAILER_LINES = 64
MAX_SIZE_DIGITS = 16  # hex digits of a chunk size (past 64 bits is no size a bound admits)
READ_BYTES = 1 << 20  # a chunk's data is read in pieces of at most this
HEX = frozenset(hexdigits.encode())
CUT_SHORT = "the chunked request body ended before its last (0-size) chunk and empty line"


class ChunkError(Exception):
    """Malformed chunking; its message is the 400's (one line)."""


class BodyTooLarge(Exception):
    """A body whose decoded size passes the bound it is read under."""


def codings(headers: Message) -> list[str]:
    """The transfer codings of the request's Transfer-Encoding headers, in order, lower-case."""
    named = ",".join(headers.get_all("Transfer-Encoding", ()))
    return [c.strip().lower() for c in named.split(",") if c.strip()]


def framing_error(headers: Message, version: str) -> ApiError | None:
    """What keeps the body's end from being known, as the answer's ApiError (the connection
    is then closed, the body unread), or None: the body is `Content-Length` bytes (none
    without one), or chunked when Transfer-Encoding is present."""
    if "Transfer-Encoding" in headers:
        return _coding_error(headers, version)
    lengths = headers.get_all("Content-Length", ())
    raw = lengths[0] if lengths else "0"
    if len(set(lengths)) > 1:
        return ApiError(400, "two Content-Lengths disagree; send one")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        return ApiError(400, f"Content-Length must be a count of bytes, got {raw[:20]!r}")
    return None


def _coding_error(headers: Message, version: str) -> ApiError | None:
    named = codings(headers)
    if version != "HTTP/1.1":
        return ApiError(400, f"Transfer-Encoding came on an {version} request, which has no "
                        "chunked coding: send HTTP/1.1, or the body with a Content-Length")
    if not named:
        return ApiError(400, "Transfer-Encoding names no coding: send 'chunked' or a "
                        "Content-Length")
    unknown = [c for c in named if c != "chunked"]
    if unknown:
        return ApiError(501, f"Transfer-Encoding {', '.join(unknown)[:100]} is not supported: "
                        "send the body as it is, chunked or with a Content-Length")
    if len(named) > 1:
        return ApiError(400, "the chunked coding may be applied once; send "
                        "'Transfer-Encoding: chunked'")
    if "Content-Length" in headers:
        return ApiError(400, "a request with both Transfer-Encoding and Content-Length is "
                        "refused (RFC 9112 6.3): send one of them")
    return None


class ChunkedBody:
    """A chunked body on `rfile` (a buffered reader of the connection), read with `read`;
    `size` counts its decoded bytes so far. A slow client is bounded as a Content-Length
    body's is: each read of the socket waits at most its timeout."""

    def __init__(self, rfile) -> None:
        self.rfile, self.size = rfile, 0
        self._pending: int | None = None  # a chunk size read but not its data (past a bound)

    def read(self, limit: int, keep: bool = True) -> bytes:
        """The body decoded through its last chunk and trailer lines (ignored), `b""` when not
        `keep` (its bytes read and dropped). Raises ChunkError when it is malformed or cut
        short, BodyTooLarge (before the chunk's data is read) when a chunk would take `size`
        past `limit`; a later call (a larger limit) goes on from there."""
        out = bytearray()
        while True:
            if self._pending is None:
                self._pending = self._size_line()
            n = self._pending
            if n == 0:
                self._trailers()
                return bytes(out)
            if self.size + n > limit:
                raise BodyTooLarge
            self._data(n, out if keep else None)
            self.size += n
            self._pending = None

    def _line(self, what: str) -> bytes:
        """One line with its CRLF cut off; ChunkError when it is too long, ends in a bare
        LF, or the body ends first."""
        line = self.rfile.readline(MAX_LINE_BYTES + 1)
        if not line.endswith(b"\n"):
            if len(line) > MAX_LINE_BYTES:
                raise ChunkError(f"a chunked body's {what} line is over {MAX_LINE_BYTES} bytes")
            raise ChunkError(CUT_SHORT)
        if not line.endswith(b"\r\n"):
            raise ChunkError(f"a chunked body's {what} line must end with CRLF, not a bare LF")
        return line[:-2]

    def _size_line(self) -> int:
        """A chunk's size, its extensions (after `;`) passed over."""
        size = self._line("chunk size").split(b";", 1)[0].rstrip(b" \t")
        if not size or len(size) > MAX_SIZE_DIGITS or not HEX.issuperset(size):
            shown = size[:20].decode("latin-1")
            raise ChunkError(f"a chunk size must be 1 to {MAX_SIZE_DIGITS} hexadecimal digits, "
                             f"got {shown!r}")
        return int(size, 16)

    def _data(self, n: int, out: bytearray | None) -> None:
        """A chunk's `n` bytes of data (onto `out`, unless None) and the CRLF after them."""
        while n > 0:
            piece = self.rfile.read(min(n, READ_BYTES))
            if not piece:
                raise ChunkError(CUT_SHORT)
            if out is not None:
                out += piece
            n -= len(piece)
        end = self.rfile.read(2)
        if len(end) < 2:
            raise ChunkError(CUT_SHORT)
        if end != b"\r\n":
            raise ChunkError("a chunk's data must be followed by CRLF: its size line gives "
                             "its length in hexadecimal")

    def _trailers(self) -> None:
        """The trailer lines after the last chunk, through the empty line that ends them."""
        for _ in range(MAX_TRAILER_LINES + 1):
            if not self._line("trailer"):
                return
        raise ChunkError(f"a chunked body has over {MAX_TRAILER_LINES} trailer lines")
