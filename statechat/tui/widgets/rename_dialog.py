"""RenameDialog: a small box over the app asking for a chat's new name."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from statechat.tui.format import one_line


class RenameDialog(ModalScreen[None]):
    """Asks for a new name for the chat titled `title`, the old one in the box, selected (typing
    replaces it). Enter hands the name, on one line, to `save`, which returns whether the
    dialog is done (False: it stays, the text in it, as for an empty name, refused here with a
    notice); Esc closes it, nothing changed."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "cancel", "Keep the name")]

    def __init__(self, title: str, save: Callable[[str], bool]) -> None:
        super().__init__(id="rename")
        self.old_title, self.save = title, save

    def compose(self) -> ComposeResult:
        with Vertical(id="rename-box"):
            yield Label("Rename the chat (Enter saves, Esc keeps the name)", markup=False)
            yield Input(value=self.old_title, select_on_focus=True)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        name = one_line(event.value)
        if not name:
            self.app.notify(f"A chat needs a name: type one, or press Esc to keep "
                            f"'{one_line(self.old_title)}'.", severity="warning", markup=False)
        elif self.save(name):
            self.dismiss()

    def action_cancel(self) -> None:
        """Esc: close, the name kept."""
        self.dismiss()
