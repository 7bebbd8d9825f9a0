"""Renaming a chat (RenamingMixin): F2 (or n) on the chat list renames the highlighted chat, the
command palette's `Rename chat` the highlighted one while the list has focus, else the open
one. A small dialog (widgets/rename_dialog.py) holds the old name; the new one is saved in the
chats' file (ChatStore.rename), so every statechat on the cache dir lists it.
"""

from __future__ import annotations

from textual.app import SystemCommand

from statechat.chat.tree import BusyError
from statechat.tui.conversations import GONE
from statechat.tui.format import clean, one_line
from statechat.tui.widgets.conversation_list import ConversationList
from statechat.tui.widgets.rename_dialog import RenameDialog


class RenamingMixin:
    """StatechatApp's renaming. The app has `chats`, `conv_id`, `is_ready`, `is_closing` and
    `open_conversation()` (conversations.py)."""

    def get_system_commands(self, screen):
        """The command palette's commands: those before, then Rename chat once the chat
        shows."""
        yield from super().get_system_commands(screen)
        if self.is_ready:
            yield SystemCommand("Rename chat", "Name the chat highlighted in the chat list, "
                                "else the one open", self.action_rename_chat)

    def action_rename_chat(self) -> None:
        """Rename chat (the palette): the chat highlighted while the list has focus, else the
        open one."""
        chat_list = self.query_one(ConversationList)
        if self.focused is chat_list and chat_list.highlighted_chat() is not None:
            self.ask_rename(chat_list.highlighted_chat())
        else:
            self.ask_rename(self.conv_id)

    def on_conversation_list_rename(self, event: ConversationList.Rename) -> None:
        """F2 or n on the chat list."""
        self.ask_rename(event.conv_id)

    def ask_rename(self, conv_id: str | None) -> None:
        """Open the dialog renaming `conv_id`; a notice where there is none yet (a new chat,
        named by its first message) or another process deleted it."""
        if self.is_closing:
            return
        if conv_id is None:
            self.notify("No chat to rename yet: a new chat is made, and named, by its first "
                        "message.")
            return
        if not self.chats.has_conversation(conv_id):
            self._after_rename(conv_id, gone=True)
            return
        title = self.chats.conversation(conv_id).title
        outcome: dict = {}

        def save(name: str) -> bool:
            try:
                outcome["gone"] = not self.chats.rename(conv_id, name)
            except BusyError as e:  # (the dialog stays, the name in it, to try again)
                self.notify(f"Not renamed: {e}.", severity="error", markup=False)
                return False
            outcome["name"] = name
            return True

        self.push_screen(RenameDialog(clean(title), save),
                         callback=lambda _: self._after_rename(conv_id, **outcome))

    def _after_rename(self, conv_id: str, gone: bool = False, name: str | None = None) -> None:
        """The dialog closed: the chat list read again (another process may have changed it
        too), and what became of the name said."""
        if self.is_closing:
            return
        if gone:
            self.open_conversation(None if conv_id == self.conv_id else self.conv_id)
            self.notify(GONE.format("That chat"), severity="warning")
            return
        self.query_one(ConversationList).show(self.chats.conversations(), self.conv_id)
        if name is not None:
            self.notify(f"Renamed the chat '{one_line(name)}'.", markup=False)
