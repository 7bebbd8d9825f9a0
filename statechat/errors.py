"""Errors a user can cause. Each carries one sentence that says what is wrong and what to do.

The CLI, TUI and server print `str(error)` on one line; a traceback only with STATECHAT_DEBUG=1.
"""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """An unexpected error's message in one line (its type's name where it has none)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class StatechatError(Exception):
    """Base of every error statechat reports to a user as one line."""


class ModelError(StatechatError):
    """A checkpoint directory that cannot be loaded (missing file, wrong type, bad tensor)."""


class ConfigError(StatechatError):
    """An invalid option or configuration value."""


class ContextLengthError(ConfigError):
    """A prompt that leaves no room in the context (the server's `context_length_exceeded`)."""


class ShuttingDownError(StatechatError):
    """A request that came as the engine stops (the server answers 503: not the client's fault)."""


class ReaderGone(Exception):
    """Standard output's reader went away (a broken pipe: `statechat cache ls | head -1`): the
    command ends at once and quietly, as `cat` and `grep` do, with the exit status a shell
    reports for a command that SIGPIPE ended (128 + 13), which `set -o pipefail` sees as theirs.
    Not an OSError, so that neither an `except OSError` on the way nor Typer's own handling of a
    broken pipe (exit status 1) takes it for another error."""

    exit_code = 141
