"""MessageView: one message of the branch on screen, with its branch switcher and status line."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group
from rich.markdown import Markdown
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.widgets import Static

from statechat.chat.tree import Message
from statechat.tui.format import clean, split_thinking, status_line

BRANCHES = Binding.Group("Branch", compact=True)  # [ ] in the footer as one key
ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}


class MessageView(Vertical, can_focus=True):
    """Focus it (click, or up/down in the chat) and: e edits (a user's or a system message), r
    regenerates, c continues a reply, [ ] switch branch, d d deletes the branch (the first d
    asks), y copies its text (sharing.py). A system message shows dimmed (app.tcss)."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("e", "app.edit_message", "Edit"),
        Binding("r", "app.regenerate", "Regenerate"),
        Binding("c", "app.continue_reply", "Continue"),
        Binding("left_square_bracket,left", "app.prev_branch", "Prev branch", key_display="[",
                group=BRANCHES),
        Binding("right_square_bracket,right", "app.next_branch", "Next branch", key_display="]",
                group=BRANCHES),
        Binding("d", "app.delete_branch", "Delete"),
        Binding("y", "app.copy_message", "Copy"),  # (c continues; y: vim's yank)
    ]

    def __init__(self, message: Message, position: int = 1, num_siblings: int = 1,
                 thinking: bool = False) -> None:
        """`thinking`: the reply's prompt opened its reasoning (a reply streaming; one that
        ended says so in its stats' `thinking`)."""
        super().__init__(classes=f"message {message.role}")
        self.message, self.position, self.num_siblings = message, position, num_siblings
        self.text, self.status = message.content, status_line(message.stats)
        self.thinking = thinking or message.stats.get("thinking") is True

    def shows_as(self, other: MessageView) -> bool:
        """Whether this view shows what `other` would: the same message (id, text, stats), the
        same text and status line now (a reply streaming shows its text so far), the same
        place among its siblings, its reasoning shown alike."""
        return (self.message == other.message and self.text == other.text
                and self.status == other.status and self.thinking == other.thinking
                and (self.position, self.num_siblings) == (other.position, other.num_siblings))

    def compose(self) -> ComposeResult:
        """Its header (role, branch switcher, links), its text, its status line."""
        yield Static(self._header(), classes="header")
        yield Static(self._body(), classes="body")
        yield Static(Text(self.status), classes="status")

    def _header(self) -> str:
        role = ROLE_NAMES.get(self.message.role) or escape(clean(self.message.role))  # (a
        # row edited by hand: its role as it is, as text)
        mid = self.message.id
        parts = [f"[b]{role}[/b]"]
        if self.num_siblings > 1:
            parts.append(f"[@click=app.prev_branch('{mid}')]‹[/] "
                         f"{self.position}/{self.num_siblings} "
                         f"[@click=app.next_branch('{mid}')]›[/]")
        action, label = (("edit_message", "edit") if self.message.role in ("user", "system")
                         else ("regenerate", "regenerate"))
        parts.append(f"[@click=app.{action}('{mid}')]{label}[/]")
        if self.message.role == "assistant" and self.message.content:  # (c says why not, else)
            parts.append(f"[@click=app.continue_reply('{mid}')]continue[/]")
        parts.append(f"[@click=app.copy_message('{mid}')]copy[/]")
        parts.append(f"[@click=app.delete_branch('{mid}')]delete[/]")
        return "  ".join(parts)

    def _body(self):
        text = clean(self.text)
        if self.message.role != "assistant":
            return Text(text)
        reasoning, answer = split_thinking(text, opened=self.thinking)
        if not reasoning:
            return Markdown(answer or "…")
        thought = Text(f"thinking: {reasoning}", style="dim italic")
        return Group(thought, Markdown(answer)) if answer else thought

    def set_message(self, message: Message) -> None:
        """Show `message` as stored now (a reply that ended: its links, its text); before the
        view is built, its build shows it."""
        self.message = message
        self.thinking = self.thinking or message.stats.get("thinking") is True
        for header in self.query(".header").results(Static):
            header.update(self._header())
        self.set_text(message.content)

    def set_text(self, text: str) -> None:
        """Show streamed text (replacing what was shown); before the view is built, its build
        shows it."""
        self.text = text
        for body in self.query(".body").results(Static):
            body.update(self._body())

    def set_status(self, text: str) -> None:
        """Show `text` as its status line (before the view is built, its build shows it)."""
        self.status = text
        for status in self.query(".status").results(Static):
            status.update(Text(text))
