"""Keys typed before the app takes the terminal (`typeahead`).

`statechat run` imports torch and reads the model's config for seconds before Textual puts the
terminal in raw mode. Until then the terminal is in its cooked mode, whose line discipline
eats Ctrl+Q and Ctrl+S (XON/XOFF flow control: a Ctrl+Q pressed then never reached the app,
which kept running) and echoes what is typed over the shell (`^Q` left on it after the app).
`typeahead()`, entered first thing, turns flow control, echo and line editing off, so every
key waits for the app (Textual reads it as the app starts), and puts the terminal back as it
was once the app is done. Ctrl+C and Ctrl+Z still signal until the app takes the terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

try:
    import termios
except ImportError:  # (no termios on Windows: its console has no such line discipline)
    termios = None


def _stdin_fd() -> int | None:
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # (closed, replaced, or no file behind it)
        return None


@contextlib.contextmanager
def typeahead(fd: int | None = None) -> Iterator[None]:
    """Within it, terminal `fd` (default: standard input) passes every key on as typed: no
    XON/XOFF (Ctrl+Q, Ctrl+S), no echo, no line editing. Its settings as they were come back
    at the end, whatever the app did to them. Nothing happens where `fd` is not a terminal."""
    fd = _stdin_fd() if fd is None else fd
    if termios is None or fd is None or not os.isatty(fd):
        yield
        return
    try:
        before = termios.tcgetattr(fd)
    except termios.error:
        yield
        return
    attrs = termios.tcgetattr(fd)
    attrs[0] &= ~(termios.IXON | termios.IXOFF)  # iflag
    attrs[3] &= ~(termios.ECHO | termios.ICANON)  # lflag
    attrs[6][termios.VMIN], attrs[6][termios.VTIME] = 1, 0  # cc: (each key readable at once)
    with contextlib.suppress(termios.error):
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
    try:
        yield
    finally:
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSANOW, before)
