"""The warnings of statechat's engine and cache (the `statechat` loggers) while the app runs,
shown as notices. Python's logging writes them to standard error, which Textual takes over
while it draws and drops: a cache dir whose disk filled (`could not persist a checkpoint`) or
that became read-only said nothing, and the chats went on without their checkpoints saved.
"""

from __future__ import annotations

import logging

from textual.message import Message

LOGGER = "statechat"  # the loggers whose warnings the app shows (statechat.cache, .engine, ...)


class Warned(Message):
    """A warning was logged: `text`, its one line, for a notice (`is_error`: an error's)."""

    def __init__(self, text: str, is_error: bool) -> None:
        super().__init__()
        self.text, self.is_error = text, is_error


class LogNotices(logging.Handler):
    """Posts each WARNING (or worse) record of LOGGER to `app` as Warned, from any thread
    (Textual's post_message is thread-safe and never waits: a cache writer thread that warns
    while the app waits on it, as it quits, is not held). Once the app is closing, the
    records' lines are kept in `late`, for the app to print once the terminal is its
    caller's again (StatechatApp.run does)."""

    def __init__(self, app) -> None:
        super().__init__(logging.WARNING)
        self.app = app
        self.late: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = (record.getMessage().splitlines() or [""])[0]  # (no traceback: one line)
        except Exception:  # noqa: BLE001 - logging's way: a bad record is reported, not raised
            self.handleError(record)
            return
        is_error = record.levelno >= logging.ERROR
        if self.app.is_closing or not self.app.post_message(Warned(text, is_error)):
            self.late.append(text)

    def install(self) -> None:
        logging.getLogger(LOGGER).addHandler(self)

    def remove(self) -> None:
        logging.getLogger(LOGGER).removeHandler(self)
