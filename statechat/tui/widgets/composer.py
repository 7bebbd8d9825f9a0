"""Composer: the input box; Enter sends, or submits an edit while editing a message."""

from __future__ import annotations

from textual.widgets import Input

PLACEHOLDER = "Message (Enter sends)"


class Composer(Input):
    """An Input that knows whether it is editing an earlier message (`editing` holds its id)."""

    def __init__(self) -> None:
        super().__init__(placeholder=PLACEHOLDER, id="composer")
        self.editing: str | None = None

    def start_edit(self, msg_id: str, text: str) -> None:
        self.editing = msg_id
        self.value = text
        self.placeholder = "Edit the message (Enter makes a new branch, Esc cancels)"
        self.border_title = "editing: Enter makes a new branch, Esc cancels"
        self.add_class("editing")
        self.focus()

    def end_edit(self) -> None:
        self.editing = None
        self.placeholder = PLACEHOLDER
        self.border_title = None
        self.remove_class("editing")
