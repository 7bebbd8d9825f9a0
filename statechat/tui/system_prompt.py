"""A chat's system message (SystemPromptMixin): `statechat run --system-prompt` gives every chat
begun in the session one, as its root message (chats from before keep theirs); `e` on it edits
it as a new root beside it, a branch of its own that the next message sent goes on from.

Chats that begin with one system message share its tokens up to where the first user message's
text begins. A prompt's checkpoint lies at its last block boundary, past that point (in the
user's text), so a second chat could reuse none of it: before the first prompt of a branch that
begins with a system message, the app has the engine compute that shared prefix alone (a
request for no tokens, whose checkpoint lies at its last block boundary), once a session for
each system message, unless the prompt's own checkpoint would lie at that boundary anyway. The
prompt itself then resumes from it, and so does every later chat with that system message.
"""

from __future__ import annotations

import contextlib

from statechat.chat.next_turn import next_turn_prefix
from statechat.chat.tree import BusyError, Message
from statechat.engine.sampling import SamplingParams
from statechat.tui.format import chat_title
from statechat.tui.widgets.composer import Composer


class SystemPromptMixin:
    """StatechatApp's system messages. The app has `system_prompt` (the session's, or None),
    `warmed_systems` (the system prefixes computed this session), `chats`, `conv_id`, `worker`,
    `template_kwargs`, `_add()` (replies.py) and `open_conversation()` (conversations.py)."""

    def begin_chat(self, text: str) -> tuple[bool, str | None]:
        """Create the chat of a first message `text` (titled with it) with the session's system
        message as its root; (whether it was made, the id of the message the first one
        follows: the system message, or None). A failure is said in a notice, and leaves no
        chat behind (the text stays in the box)."""
        try:
            self.conv_id = self.chats.create(title=chat_title(text)).id
        except BusyError as e:
            self.notify(f"Not sent: {e}.", severity="error", markup=False)
            return False, None
        if not self.system_prompt:
            return True, None
        system = self._add(None, "system", self.system_prompt)
        if system is None:  # (said: a chat with no system message would be sent next)
            with contextlib.suppress(BusyError):  # (else it stays, empty)
                self.chats.delete_conversation(self.conv_id)
            self.conv_id = None
            return False, None
        return True, system.id

    def send_system_edit(self, edited: Message, sent: str, text: str) -> None:
        """Enter on an edit of system message `edited`: `text` as a new system message beside
        it (a new branch, shown alone: the next message sent goes on from it); `sent`: the
        box's text as sent."""
        system = self._add(edited.parent_id, "system", text)
        if system is None:  # (said; the text stays in the box)
            return
        self.query_one(Composer).take(sent)
        self.open_conversation(self.conv_id)

    def warm_system_prefix(self, history: list[dict], prompt_ids: list[int]) -> None:
        """(Before the prompt `prompt_ids` of `history` is submitted) have the engine compute
        the prefix that a branch beginning with `history`'s system message shares with every
        other, where this prompt is its first turn (module docstring)."""
        if (len(history) != 2 or history[0]["role"] != "system"
                or not self.worker.engine.config.enable_prefix_cache):
            return
        prefix = next_turn_prefix(
            lambda messages: self.worker.render(messages, add_generation_prompt=False,
                                                template_kwargs=self.template_kwargs),
            history[:1])
        bs = self.worker.engine.config.block_size
        mark = len(prefix) // bs * bs
        key = tuple(prefix)
        if (mark == 0 or prompt_ids[:len(prefix)] != prefix or key in self.warmed_systems
                or (len(prompt_ids) - 1) // bs * bs == mark):
            return
        self.warmed_systems.add(key)
        self.worker.submit(prefix, SamplingParams(max_tokens=0), request_id="system-prompt")
