"""`run`'s and `batch`'s system prompt: `--system-prompt TEXT` (`-sys`, as llama.cpp's, or
$STATECHAT_SYSTEM_PROMPT) or `--system-prompt-file PATH` (`-sysf`), read before the model loads
(a file that cannot be used is one line, and nothing starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from statechat.errors import StatechatError

SystemPromptOpt = Annotated[str | None, typer.Option(
    "--system-prompt", "-sys", metavar="<text>", envvar="STATECHAT_SYSTEM_PROMPT",
    help="System message that new chats (run) or lines with none of their own (batch) begin "
    "with; blank: none.")]
SystemPromptFileOpt = Annotated[Path | None, typer.Option(
    "--system-prompt-file", "-sysf", metavar="<path>", help="Read --system-prompt from a UTF-8 "
    "text file.")]


def system_prompt(ctx: typer.Context, text: str | None, path: Path | None) -> str | None:
    """The system prompt of a command given `text` (--system-prompt or its variable: the
    command's parameter `system_prompt_text`) and `path`
    (--system-prompt-file), blank space around it dropped; None where it is empty or neither
    is given. A file on the command line wins over the variable's text; both flags on the
    command line, or a file that is missing, unreadable or not UTF-8, is one line."""
    if path is not None:
        source = ctx.get_parameter_source("system_prompt_text")  # (click's ParameterSource,
        # or that of the click Typer carries: told by name)
        if text is not None and getattr(source, "name", None) != "ENVIRONMENT":
            raise StatechatError("give --system-prompt or --system-prompt-file, not both")
        text = read_text(path)
    text = (text or "").strip()
    return text or None


def read_text(path: Path) -> str:
    """The text of --system-prompt-file `path` (a UTF-8 byte-order mark dropped); one line for
    a file that cannot be used."""
    flag = f"--system-prompt-file {path}"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StatechatError(f"{flag} does not exist") from None
    except IsADirectoryError:
        raise StatechatError(f"{flag} is a folder; pass a text file") from None
    except OSError as e:
        raise StatechatError(f"{flag} cannot be read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise StatechatError(f"{flag} is not UTF-8 text (byte {e.start + 1}); save it as "
                             "UTF-8") from None
