"""ChatView: the scrolling branch of the open conversation."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding
from textual.containers import VerticalScroll

from statechat.tui.widgets.message_view import MessageView


class ChatView(VerticalScroll, can_focus=False):
    """Holds one MessageView per message of the branch; up/down move between them.

    Not focusable itself, so Shift-Tab from the input lands on the last message.
    """

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("up,k", "move(-1)", "Prev msg", show=False),
        Binding("down,j", "move(1)", "Next msg", show=False),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # the views shown: those replaced stay in the DOM a moment, and a streamed update
        # sent to one of them would be lost
        self.shown: list[MessageView] = []

    def on_mount(self) -> None:
        self.anchor()  # stay scrolled to the bottom while a reply grows

    def show(self, views: list[MessageView]) -> None:
        self.remove_children()
        self.mount_all(views)
        self.shown = views
        self.anchor()

    def views(self) -> list[MessageView]:
        return list(self.shown)

    def view_of(self, msg_id: str) -> MessageView | None:
        return next((v for v in self.views() if v.message.id == msg_id), None)

    def action_move(self, step: int) -> None:
        views = self.views()
        if not views:
            return
        focused = self.screen.focused
        i = views.index(focused) if focused in views else (len(views) if step < 0 else -1)
        target = views[max(0, min(len(views) - 1, i + step))]
        target.focus()
        self.scroll_to_widget(target, animate=False)
