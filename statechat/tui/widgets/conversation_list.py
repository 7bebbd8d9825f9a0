"""ConversationList: the sidebar of saved conversations, newest first."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding
from textual.message import Message
from textual.widgets import Label, ListItem, ListView

from statechat.chat.tree import Conversation
from statechat.tui.format import clean, one_line


class ConversationList(ListView):
    """Enter or a click opens a conversation; Delete (or Backspace) asks to remove it (and its
    whole tree), the key again removes it (the app asks: conversations.py); F2 or n renames it
    (renaming.py). Focused, it
    highlights a chat (the open one, else the first), so Enter always opens one."""

    BINDINGS: ClassVar[list[Binding]] = [  # (Backspace: the key a Mac labels Delete)
        Binding("delete,backspace", "delete_conversation", "Delete chat", key_display="del"),
        Binding("f2,n", "rename_conversation", "Rename")]

    class Open(Message):
        def __init__(self, conv_id: str) -> None:
            super().__init__()
            self.conv_id = conv_id

    class Delete(Message):
        def __init__(self, conv_id: str) -> None:
            super().__init__()
            self.conv_id = conv_id

    class Rename(Message):
        def __init__(self, conv_id: str) -> None:
            super().__init__()
            self.conv_id = conv_id

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.conv_ids: list[str] = []  # the chats listed, in order
        self.rows: list[tuple[str, str]] = []  # (id, title) of each, as listed
        self.is_highlighting = False  # items just built, their highlight not set yet

    def show(self, conversations: list[Conversation], current: str | None) -> None:
        """Replace the items (kept where they list the same chats, titled the same); highlight
        `current`, or, while the list has focus, the chat the user highlighted (a reply ending
        meanwhile moved the highlight to its chat, which the next Delete then deleted)."""
        chosen = self._conv_at(self.index) if self.has_focus else None
        rows = [(c.id, one_line(clean(c.title))) for c in conversations]
        ids = [conv_id for conv_id, _ in rows]
        keep = chosen if chosen in ids else current
        index = ids.index(keep) if keep in ids else None
        if rows == self.rows and not self.is_highlighting:  # (the same: kept, highlighted now,
            # so that Down pressed just after Ctrl+L moves from there, not undone once built)
            self._highlight(index)
            return
        self.conv_ids, self.rows, self.is_highlighting = ids, rows, True
        self.clear()
        self.extend(ListItem(Label(title, markup=False)) for _, title in rows)
        self.call_after_refresh(self._highlight, index)

    def _highlight(self, index: int | None) -> None:
        """Highlight the item at `index`; with none, the first while the list has focus."""
        self.is_highlighting = False
        self.index = 0 if index is None and self.has_focus and self.conv_ids else index

    def on_focus(self) -> None:
        """Highlight the first chat if none is, so that Enter opens one."""
        if self.index is None and self.conv_ids:  # (runs before has_focus is set)
            self.index = 0

    def highlighted_chat(self) -> str | None:
        """The id of the chat highlighted, if one is."""
        return self._conv_at(self.index)

    def _conv_at(self, index: int | None) -> str | None:
        ids = self.conv_ids
        return ids[index] if index is not None and 0 <= index < len(ids) else None

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        """Enter or a click: post Open for the highlighted chat."""
        event.stop()
        conv_id = self._conv_at(self.index)
        if conv_id is not None:
            self.post_message(self.Open(conv_id))

    def action_delete_conversation(self) -> None:
        """Delete: post Delete for the highlighted chat (the app asks before it deletes)."""
        conv_id = self._conv_at(self.index)
        if conv_id is not None:
            self.post_message(self.Delete(conv_id))

    def action_rename_conversation(self) -> None:
        """F2 or n: post Rename for the highlighted chat (the app asks for the name)."""
        conv_id = self._conv_at(self.index)
        if conv_id is not None:
            self.post_message(self.Rename(conv_id))
