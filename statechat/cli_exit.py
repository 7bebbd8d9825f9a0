"""How a `statechat` command ends (cli.main): the exit status of what the Typer app returned or
raised, a known error said in one line first (`statechat: ...`; the traceback only with
STATECHAT_DEBUG=1), a usage error in one line with a hint, a reader of standard output gone
(ReaderGone) quietly with 141; and the process's end, at once where `run`'s app closed all."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import typer

from statechat.cli_options import broken_pipe_as_reader_gone
from statechat.errors import ReaderGone, StatechatError


def exit_status(app) -> int:
    """Run the Typer `app` (standalone_mode off) and give its exit status; known errors are
    said in one line on stderr, a reader gone is said nothing to."""
    try:
        code = _run_app(app)
    except ReaderGone as e:  # (quietly, as SIGPIPE ends `cat`)
        _quiet_stdout()
        code = e.exit_code
    return code if isinstance(code, int) else 0


def _run_app(app):
    """The app run, its exit status; a known error said in one line (the status its own)."""
    try:
        return app(standalone_mode=False)  # a raised typer.Exit comes back as its exit code
    except StatechatError as e:
        if os.environ.get("STATECHAT_DEBUG") == "1":
            raise
        typer.secho(f"statechat: {e}", fg="red", err=True)
        return getattr(e, "exit_code", 2)
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort as e:  # (Ctrl+C; SIGTERM in a batch is 143)
        return getattr(e.__cause__, "exit_code", 130)
    except Exception as e:
        # errors of Typer's click: a usage error is one line (click's own form is four: usage,
        # hint, blank, error); the others (help asked by no arguments) show themselves
        if not (callable(getattr(e, "show", None)) and hasattr(e, "exit_code")):
            raise
        if _is_usage_error(e):
            help_hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            typer.secho(f"statechat: {e.format_message()}{help_hint}", fg="red", err=True)
        else:
            with broken_pipe_as_reader_gone():  # (the help, into a closed pipe)
                e.show()
        return e.exit_code


def _quiet_stdout() -> None:
    """Point standard output at /dev/null: what it still buffers for a reader that went away
    would fail again as Python exits (`Exception ignored ... BrokenPipeError`)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _is_usage_error(e: Exception) -> bool:
    """Whether `e` is a usage error of click (or of the copy of click that Typer 0.2x carries),
    other than the one that shows a command's help when it is given no arguments."""
    names = {cls.__name__ for cls in type(e).__mro__}
    return "UsageError" in names and "NoArgsIsHelpError" not in names


def end_process(code: int, at_once: bool) -> None:
    """End the process with `code`: `at_once` (after `run`'s app closed everything it opened)
    without the interpreter's teardown, what Python still buffers flushed first; else as
    sys.exit does (returning for 0)."""
    if at_once:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        logging.shutdown()
        os._exit(code)
    if code:
        sys.exit(code)
