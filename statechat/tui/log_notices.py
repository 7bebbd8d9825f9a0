"""The warnings of statechat's engine and cache (the `statechat` loggers) while the app runs,
shown as notices. Python's logging writes them to standard error, which Textual takes over
while it draws and drops: a cache dir whose disk filled (`could not persist a checkpoint`) or
that became read-only said nothing, and the chats went on without their checkpoints saved.

A failing disk can warn hundreds of times a second: a line already showing is not shown again,
and past MAX_NOTICES at once the lines are held (one notice says so) and printed after the app,
with those logged as it closes (a notice each froze the app: Textual mounted thousands).
"""

from __future__ import annotations

import logging
import time

from textual.message import Message

LOGGER = "statechat"  # the loggers whose warnings the app shows (statechat.cache, .engine, ...)
NOTICE_S = 10.0  # a warning's notice shows this long; its line again meanwhile is not shown
MAX_NOTICES = 3  # warnings' notices showing at once at most; lines past them are held
MAX_LATE = 40  # distinct lines held to print after the app; past them, only counted
HELD = "statechat: more warnings than fit on the screen; they are printed when statechat quits"


class Warned(Message):
    """A warning was logged: `text`, its one line, for a notice (`is_error`: an error's)."""

    def __init__(self, text: str, is_error: bool) -> None:
        super().__init__()
        self.text, self.is_error = text, is_error


class LogNotices(logging.Handler):
    """Posts WARNING (or worse) records of LOGGER to `app` as Warned, from any thread
    (Textual's post_message is thread-safe and never waits: a cache writer thread that warns
    while the app waits on it, as it quits, is not held), at most MAX_NOTICES showing at once
    and a line showing not again. The lines held, and those logged once the app is closing,
    are `late` (each once, with its count), for the app to print once the terminal is its
    caller's again (StatechatApp.run does). logging calls `emit` under the handler's lock."""

    def __init__(self, app) -> None:
        super().__init__(logging.WARNING)
        self.app = app
        self._held: dict[str, int] = {}  # line -> times logged, for `late`
        self._num_dropped = 0  # lines past MAX_LATE distinct ones
        self._shown: dict[str, float] = {}  # line -> when its notice was posted (showing)

    @property
    def late(self) -> list[str]:
        """The lines to print after the app, in the order first logged."""
        lines = [text if n == 1 else f"{text} (x{n})" for text, n in self._held.items()]
        if self._num_dropped:
            lines.append(f"statechat: {self._num_dropped} more warnings not kept")
        return lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = (record.getMessage().splitlines() or [""])[0]  # (no traceback: one line)
        except Exception:  # noqa: BLE001 - logging's way: a bad record is reported, not raised
            self.handleError(record)
            return
        now = time.monotonic()
        self._shown = {t: at for t, at in self._shown.items() if now - at < NOTICE_S}
        if self.app.is_closing:
            self._hold(text)
        elif text in self._shown:  # (showing: not again)
            return
        elif len(self._shown) >= MAX_NOTICES:
            self._hold(text)
            if HELD not in self._shown:  # (said once while it shows)
                self._post(HELD, False, now)
        elif not self._post(text, record.levelno >= logging.ERROR, now):
            self._hold(text)

    def _post(self, text: str, is_error: bool, now: float) -> bool:
        """Post `text` to the app as Warned; False if its queue is closed."""
        if not self.app.post_message(Warned(text, is_error)):
            return False
        self._shown[text] = now
        return True

    def _hold(self, text: str) -> None:
        if text in self._held or len(self._held) < MAX_LATE:
            self._held[text] = self._held.get(text, 0) + 1
        else:
            self._num_dropped += 1

    def install(self) -> None:
        logging.getLogger(LOGGER).addHandler(self)

    def remove(self) -> None:
        logging.getLogger(LOGGER).removeHandler(self)
