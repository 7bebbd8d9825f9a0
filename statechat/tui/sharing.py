"""Taking text out of the app (SharingMixin): `y` (or a message's `copy` link) copies the
message to the clipboard; the command palette's `Copy chat` copies the branch shown as Markdown
and `Export chat` writes it to a new file in the current directory (chat/transcript.py).

The clipboard is the terminal's: Textual's `copy_to_clipboard` sends it the text in an OSC 52
sequence, which a terminal (or tmux, with `set-clipboard on`) that does not take it ignores;
the app cannot tell, so its notice says what was sent.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import SystemCommand

from statechat.chat.transcript import answer_of, branch_markdown, write_new
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.conversation_list import ConversationList


def _characters(text: str) -> str:
    return f"{len(text):,} character" + ("" if len(text) == 1 else "s")


class SharingMixin:
    """StatechatApp's copy and export. The app has `conv_id` (the chat shown), `is_ready`,
    `is_closing`, and `_target()` (conversations.py)."""

    def get_system_commands(self, screen):
        """The command palette's commands: Textual's, then, once the chat shows, Copy chat and
        Export chat (and those of the mixins after this one: Rename chat)."""
        yield from super().get_system_commands(screen)
        if self.is_ready:
            yield SystemCommand("Copy chat", "Copy the branch shown to the clipboard, as "
                                "Markdown", self.action_copy_chat)
            yield SystemCommand("Export chat", "Write the branch shown to a Markdown file in "
                                "the current directory", self.action_export_chat)

    def action_copy_message(self, msg_id: str | None = None) -> None:
        """y, or a message's `copy`: its text to the clipboard as shown (a reply streaming: so
        far), a reply's answer without its reasoning."""
        if self.is_closing:
            return
        msg = self._target(msg_id, "Pick a message to copy.")
        if msg is None:
            return
        view = self.query_one(ChatView).view_of(msg.id)
        text = view.text if view is not None else msg.content
        left_out = False
        if msg.role == "assistant":
            thinking = view.thinking if view is not None else msg.stats.get("thinking") is True
            text, left_out = answer_of(text, thinking)
        self.copy_to_clipboard(text)
        note = " (the answer; its reasoning left out)" if left_out else ""
        self.notify(f"Copied {_characters(text)}{note}.")

    def action_copy_chat(self) -> None:
        """Copy chat: the branch shown, as Markdown, to the clipboard."""
        markdown = self._shown_markdown("copy")
        if markdown is not None:
            self.copy_to_clipboard(markdown)
            self.notify(f"Copied the chat as Markdown ({_characters(markdown)}).")

    def action_export_chat(self) -> None:
        """Export chat: the branch shown, as Markdown, to a new file in the current directory
        named from the chat's title (transcript.write_new); a directory that cannot be written
        is said in one line."""
        markdown = self._shown_markdown("export")
        if markdown is None:
            return
        try:
            directory = Path.cwd()
        except OSError as e:  # (the directory was deleted since `run` started in it)
            self.notify(f"Could not export the chat: the current directory is gone "
                        f"({e.strerror or e}).", severity="error", markup=False)
            return
        try:
            path = write_new(directory, self._shown_title(), markdown)
        except OSError as e:
            self.notify(f"Could not export the chat to {directory}: {e.strerror or e}.",
                        severity="error", markup=False)
            return
        self.notify(f"Exported the chat to {path}.", markup=False)

    def _shown_markdown(self, what: str) -> str | None:
        """The branch shown as Markdown; None, said in a notice, where it has no message."""
        if self.is_closing:
            return None
        views = self.query_one(ChatView).views()
        if not views:
            self.notify(f"Nothing to {what}: this chat has no messages yet.")
            return None
        turns = [(v.message.role, v.text, v.thinking) for v in views]
        return branch_markdown(self._shown_title(), turns)

    def _shown_title(self) -> str:
        """The open chat's title as the chat list shows it."""
        rows = self.query_one(ConversationList).rows
        return next((title for conv_id, title in rows if conv_id == self.conv_id), "chat")
