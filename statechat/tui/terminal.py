"""Keys typed before the app takes the terminal (`typeahead`), and whether there is a terminal
to take (`require_terminal`).

`statechat run` imports torch and reads the model's config for seconds before Textual puts the
terminal in raw mode. Until then the terminal is in its cooked mode, whose line discipline
eats Ctrl+Q and Ctrl+S (XON/XOFF flow control: a Ctrl+Q pressed then never reached the app,
which kept running) and echoes what is typed over the shell (`^Q` left on it after the app).
`typeahead()`, entered first thing, turns flow control, echo and line editing off, so every
key waits for the app (Textual reads it as the app starts), and puts the terminal back as it
was once the app is done, also when SIGTERM, SIGHUP or SIGQUIT come while it starts or after
the app has given them back (they exit with status 128 + their number; the app quits on SIGTERM
and SIGHUP itself while it runs). Ctrl+C and Ctrl+Z still signal until the app takes the
terminal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator

from statechat.errors import StatechatError

try:
    import termios
except ImportError:  # (no termios on Windows: its console has no such line discipline)
    termios = None

# signals that end the process while `run` starts (`kill`, a closed terminal, Ctrl-backslash)
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT")
                       if hasattr(signal, name))


def _stdin_fd() -> int | None:
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # (closed, replaced, or no file behind it)
        return None


def require_terminal() -> None:
    """A one-line StatechatError unless standard input and standard error are terminals: the
    app (Textual) reads its keys from the one and draws on the other. Without them it waited
    for keys that never come (`ssh host statechat run` without -t, nohup, cron), drawing into
    whatever took its output."""
    if not all(_is_terminal(stream) for stream in (sys.stdin, sys.stderr)):
        raise StatechatError("run is the terminal app: it reads keys from standard input and "
                             "draws on standard error, and here they are not a terminal; for "
                             "scripts use `statechat batch` or `statechat serve`")


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, OSError, ValueError):  # (closed, or replaced by one with no file)
        return False


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

    def restore() -> None:
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSANOW, before)

    # (the signals are taken before the terminal changes and given back once it is restored:
    # a default action in between would leave it changed)
    with _exit_on(ENDING_SIGNALS, restore):
        try:
            with contextlib.suppress(termios.error):
                termios.tcsetattr(fd, termios.TCSANOW, attrs)
            yield
        finally:
            restore()


@contextlib.contextmanager
def _exit_on(signums: tuple[int, ...], clean_up: Callable[[], None]) -> Iterator[None]:
    """Within it (in the main thread), each of `signums` whose action is the default runs
    `clean_up` and raises SystemExit(128 + its number), so that the blocks being left run
    their clean-up too (`clean_up` runs first, as a signal may come in the middle of theirs);
    the handlers before come back at the end (the app installs its own while it runs, and
    gives these back as it closes)."""

    def raise_exit(signum, frame) -> None:
        clean_up()
        raise SystemExit(128 + signum)

    before = {}
    with contextlib.suppress(ValueError):  # (not the main thread: signals stay as they were)
        for signum in signums:
            if signal.getsignal(signum) is signal.SIG_DFL:
                before[signum] = signal.signal(signum, raise_exit)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
