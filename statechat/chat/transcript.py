"""A chat's branch as Markdown, and the new file it is exported to: the app's Copy chat and
Export chat (tui/sharing.py) and `statechat chats export` (cli_chats.py); no Textual here.

The Markdown: `# title`, then one `**User**:` / `**Assistant**:` / `**System**:` section per
message, in order; a reply's reasoning (shown dimmed in the app) in a collapsed `<details>`
block before its answer. Text is written as it was stored (Markdown in a reply stays Markdown).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from statechat.chat.records import Message

ROLE_HEADINGS = {"user": "User", "assistant": "Assistant", "system": "System"}
NAME_CHARS = 60  # a file name's most characters before `-N.md` (UTF-8: within 255 bytes)
_DASHES = re.compile(r"-+")


def one_line(text: str) -> str:
    """`text` with each run of whitespace, line breaks included, as one space (a chat's title)."""
    return " ".join(text.split())


def split_thinking(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a reply from a thinking model (Qwen's `<think>...</think>`): the
    reasoning is what comes before `</think>` (after an opening `<think>`, where the reply has
    one; with `opened`, its prompt opened it, as Qwen3.5's template does), and a reply still
    inside an opened `<think>` is all reasoning. Markdown would drop the tags and, with them,
    the text up to the next blank line."""
    body = text.lstrip()
    if body.startswith("<think>"):
        opened, body = True, body[len("<think>"):]
    if "</think>" in body:
        reasoning, answer = body.split("</think>", 1)
        return reasoning.strip(), answer.lstrip()
    return (body.strip(), "") if opened else ("", text)


def turns_of(messages: list[Message]) -> list[tuple[str, str, bool]]:
    """`branch_markdown`'s turns of stored messages: (role, content, thinking), `thinking` as
    a reply's stats saved it (the app's view of a reply that ended reads it the same way)."""
    return [(m.role, m.content, m.stats.get("thinking") is True) for m in messages]


def branch_markdown(title: str, turns: list[tuple[str, str, bool]]) -> str:
    """The Markdown of a branch titled `title`; `turns`: (role, text, thinking) per message,
    `thinking` where its prompt opened the reply's reasoning (tui/format.split_thinking)."""
    parts = [f"# {one_line(title)}"]
    for role, text, thinking in turns:
        parts.append(f"**{ROLE_HEADINGS.get(role, one_line(role))}**:")
        reasoning, answer = (split_thinking(text, opened=thinking) if role == "assistant"
                             else ("", text))
        if reasoning:
            parts.append(f"<details>\n<summary>Thinking</summary>\n\n{reasoning}\n\n</details>")
        if answer.strip():
            parts.append(answer.strip("\n"))
    return "\n\n".join(parts) + "\n"


def answer_of(text: str, thinking: bool) -> tuple[str, bool]:
    """What copying a reply takes: its answer, without its reasoning, where it has both
    (True: reasoning was left out); else all of it."""
    reasoning, answer = split_thinking(text, opened=thinking)
    return (answer, True) if reasoning and answer else (text, False)


def file_name(title: str) -> str:
    """A file name from a chat's title: its words joined by `-`, with no folder, dot or blank
    in it, cut to NAME_CHARS; `chat.md` for a title with no word."""
    stem = _DASHES.sub("-", "".join(ch if _in_word(ch) else "-"
                                    for ch in unicodedata.normalize("NFC", title)))
    stem = stem.strip("-_")[:NAME_CHARS].rstrip("-_")
    return f"{stem or 'chat'}.md"


def _in_word(ch: str) -> bool:
    """Whether `ch` is kept in a file name: a letter or digit of any script, `_`, or a mark
    that is part of a letter (a Devanagari vowel sign, an accent typed as a mark of its own)."""
    return ch.isalnum() or ch == "_" or unicodedata.category(ch).startswith("M")


def write_new(directory: Path, title: str, text: str) -> Path:
    """Write `text` to a new file in `directory` named from `title` (`file_name`), or, where
    that one exists, `-2`, `-3` ... before `.md`: an existing file is never overwritten (the
    exclusive open holds against another process writing the same name). OSError where the
    directory cannot be written."""
    name = file_name(title)
    stem = name[:-len(".md")]
    number = 1
    while True:
        path = Path(directory) / (name if number == 1 else f"{stem}-{number}.md")
        try:
            f = open(path, "x", encoding="utf-8")  # noqa: SIM115 - (closed below)
        except FileExistsError:
            number += 1
            continue
        try:
            with f:
                f.write(text)
        except BaseException:  # (a full disk: no half-written file is left)
            path.unlink(missing_ok=True)
            raise
        return path
