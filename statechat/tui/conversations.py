"""Opening chats and acting on their messages (ConversationsMixin): the chat list's Enter and
Delete, and a message's keys and links (e edit, r regenerate, c continue, [ ] switch branch,
d delete branch). Nothing is overwritten: an edit, a regenerate or a continuation adds a branch
(chat/tree.py). A delete cannot be undone, so it asks first: the key (or link) pressed again
within CONFIRM_S, on the same chat or message, deletes; the question lapses when the highlight
or the focus moves.

Another statechat process on the same cache dir may delete a chat or a message at any time:
each action finds its message anew and says so when it is gone (GONE). Once the app is
quitting (`is_closing`), the actions do nothing: the widgets they would fill are going.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from textual.notifications import Notification, Notify

from statechat.chat.tree import BusyError, Message
from statechat.tui.format import clean, one_line
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from statechat.tui.widgets.message_view import MessageView

GONE = "{} was deleted by another statechat process on this cache dir."
CONFIRM_S = 5.0  # a delete asked about is done by its key pressed again within this long


class ConversationsMixin:
    """StatechatApp's chat and branch actions. The app has `chats` (the ChatStore), `conv_id`
    (the chat shown), `viewed_saved` (the chat saved as viewed last), `handle`,
    `streaming_conv_id`, `streaming_reply_id` and `streaming_thinking` (the reply streaming,
    and whether its prompt opened its reasoning), `is_closing` (the app is quitting),
    `delete_asked` (the delete asked about: its target and when, None once done or lapsed),
    `delete_question` (the notice that asks it, None once gone),
    `_busy()`, `start_reply()`
    and `continuation_of()` (replies.py), and `_focus_composer()` (layout.py)."""

    def open_conversation(self, conv_id: str | None, focus_id: str | None = None) -> None:
        """Show `conv_id`'s current branch (None: a new chat) and the list of chats; with
        `focus_id`, focus that message's view (the focused view is replaced), scrolled into
        sight once it is built."""
        if conv_id is not None and not self.chats.has_conversation(conv_id):
            self.notify(GONE.format("That chat"), severity="warning")
            conv_id = None
        switched, self.conv_id = conv_id != self.conv_id, conv_id
        self._save_viewed(conv_id, switched)
        self.query_one(ConversationList).show(self.chats.conversations(), conv_id)
        branch = self.chats.branch(conv_id) if conv_id else []
        composer = self.query_one(Composer)
        if composer.editing and composer.editing not in {m.id for m in branch}:
            # (sent now, it would land in another chat, or nowhere); changed text stays
            keep = composer.changed
            composer.end_edit(keep=keep)
            stays = "; your text stays in the box, to send as a new message" if keep else ""
            self.notify(f"Edit ended: its message is no longer shown{stays}.")
        views = []
        for msg, (pos, num_sibs) in zip(branch, self.chats.places(branch)):
            thinking = False
            if msg.id == self.streaming_reply_id:  # (streaming here: no status until it ends)
                msg, thinking = dataclasses.replace(msg, stats={}), self.streaming_thinking
            views.append(MessageView(msg, pos, num_sibs, thinking=thinking))
        chat = self.query_one(ChatView)
        if isinstance(self.focused, MessageView):  # (its view may be replaced: the box takes
            # the focus; else Textual moved it to the chat list, where Delete deletes the chat,
            # and which a narrow terminal shows instead)
            chat.screen.set_focus(composer)
        chat.show(views, growing_id=self.streaming_reply_id)
        target = chat.view_of(focus_id) if focus_id else None
        if target is not None:  # (now, built or not: the keys pressed next act on its message,
            # not typed into the box; the chat scrolls to it once it is built: ChatView.show)
            chat.screen.set_focus(target, scroll_visible=False)

    def _save_viewed(self, conv_id: str | None, switched: bool) -> None:
        """Save `conv_id` as the chat viewed last (a restart opens it), unless it is None (a
        new chat, saved once its first message makes it) or was shown and saved already
        (`switched`: it was not shown before; another statechat may have saved its own since);
        a file that cannot be written for now keeps the one saved before (it is no chat's
        content)."""
        if conv_id is None or (conv_id == self.viewed_saved and not switched):
            return
        with contextlib.suppress(BusyError):
            self.chats.set_last_viewed(conv_id)
            self.viewed_saved = conv_id

    def first_chat(self) -> str | None:
        """The chat a start shows: the one viewed last, else (none saved, or it was deleted)
        the one updated last; None where there is none."""
        convs = self.chats.conversations()
        last = self.chats.last_viewed()
        if any(c.id == last for c in convs):
            return last
        return convs[0].id if convs else None

    def focused_message(self) -> str | None:
        """The id of the message focused, if one is."""
        return self.focused.message.id if isinstance(self.focused, MessageView) else None

    def on_conversation_list_open(self, event: ConversationList.Open) -> None:
        """Enter or a click on the chat list: show that chat, the box focused."""
        if self.is_closing:
            return
        self.open_conversation(event.conv_id)
        self._focus_composer()

    def on_conversation_list_delete(self, event: ConversationList.Delete) -> None:
        """Delete on the chat list: ask, then (Delete again) remove that chat, unless its reply
        is streaming."""
        if self.is_closing:
            return
        if self.handle is not None and event.conv_id == self.streaming_conv_id:
            self.notify("Its reply is streaming: stop it (Esc) before deleting this chat.",
                        severity="warning")
            return
        if not self.chats.has_conversation(event.conv_id):
            self.open_conversation(self.conv_id)  # (the list, read again, no longer has it)
            self.notify(GONE.format("That chat"), severity="warning")
            return
        title = one_line(clean(self.chats.conversation(event.conv_id).title))
        if not self._confirmed(("chat", event.conv_id), f"Delete chat '{title}' and all its "
                               "messages? Press Delete again to delete it."):
            return
        self.chats.delete_conversation(event.conv_id)
        self.open_conversation(None if event.conv_id == self.conv_id else self.conv_id)
        self.notify(f"Chat '{title}' deleted.", markup=False)

    def on_list_view_highlighted(self) -> None:
        """The chat list's highlight moved: a delete asked about lapses."""
        self._lapse_question()

    def on_descendant_focus(self) -> None:
        """The focus moved: a delete asked about lapses (the layout's own handler runs too)."""
        self._lapse_question()

    def _lapse_question(self) -> None:
        """No delete is asked about any more: its question leaves the screen (it stayed up to
        CONFIRM_S, saying to press the key again, over what was focused then)."""
        self.delete_asked = None
        if self.delete_question is not None:
            self._unnotify(self.delete_question)  # (Textual's own way to take one back)
            self.delete_question = None

    def _confirmed(self, target: tuple[str, str], question: str) -> bool:
        """Whether a delete of `target` (("chat" or "branch", its id)) is the one that confirms
        it: asked just before (within CONFIRM_S, nothing moved since). Else ask `question`, in
        a notice that lasts as long as the question holds."""
        asked = self.delete_asked
        self._lapse_question()
        if asked is not None and asked[0] == target and time.monotonic() - asked[1] < CONFIRM_S:
            return True
        self.delete_asked = (target, time.monotonic())
        self.delete_question = Notification(question, timeout=CONFIRM_S)  # (no markup)
        self.post_message(Notify(self.delete_question))  # (what `notify` does, keeping it)
        return False

    def _target(self, msg_id: str | None, hint: str | None = None,
                role: str | tuple[str, ...] | None = None) -> Message | None:
        """The message an action is for: the one clicked, else the focused one; None, said in
        one notice, when none is focused or it is not of `role` (or of one of them; `hint`:
        what to pick), or
        another statechat deleted it (GONE: the chat is shown again, the box focused)."""
        if msg_id is None:
            focused = self.focused
            if not isinstance(focused, MessageView):
                if hint:
                    self.notify(hint)
                return None
            msg_id = focused.message.id
        msg = self.chats.find(msg_id)
        if msg is None:
            self.notify(GONE.format("That message"), severity="warning")
            self.open_conversation(self.conv_id)
        elif role is not None and msg.role not in ((role,) if isinstance(role, str) else role):
            self.notify(hint)
            return None
        return msg

    def action_new_chat(self) -> None:
        """Ctrl+N: an empty chat, created when its first message is sent."""
        if self.is_closing:
            return
        self.open_conversation(None)
        self._focus_composer()

    def action_edit_message(self, msg_id: str | None = None) -> None:
        """e, or a message's `edit`: its text into the box; Enter sends it as a new branch
        (a system message's, with no reply: system_prompt.py)."""
        if self.is_closing:
            return
        msg = self._target(msg_id, "Pick one of your messages, or the system message, to edit "
                           "(r regenerates a reply).", role=("user", "system"))
        if msg is None:
            return
        self.query_one(Composer).start_edit(msg.id, msg.content)

    def action_regenerate(self, msg_id: str | None = None) -> None:
        """r, or a reply's `regenerate`: a new reply beside it (or under a user message)."""
        if self.is_closing or self._busy():
            return
        hint = "Pick a reply to regenerate."
        msg = self._target(msg_id, hint, role=("user", "assistant"))
        if msg is None:
            return
        parent = msg if msg.role == "user" else self._prompt_of(msg, hint)
        if parent is not None:
            self.start_reply(parent, focus=True)

    def action_continue_reply(self, msg_id: str | None = None) -> None:
        """c, or a reply's `continue`: a new reply beside it that goes on from its text (the
        model given the reply as it was made: chat/continuing.py), focused as after r. A reply
        with no text (failed, or stopped before its first token) has nothing to go on from."""
        if self.is_closing or self._busy():
            return
        hint = "Pick a reply with text to continue (r regenerates one)."
        msg = self._target(msg_id, hint, role="assistant")
        if msg is None:
            return
        if not msg.content:
            self.notify(hint)
            return
        parent = self._prompt_of(msg, hint)
        if parent is not None:
            self.start_reply(parent, focus=True, start=self.continuation_of(msg))

    def _prompt_of(self, msg: Message, hint: str) -> Message | None:
        """The message `msg` answers (its parent); None, `hint` said, where there is none: a
        chat's first message that is no user's, or one whose parent's row is gone (rows edited
        by hand: r and c ended the app in a traceback, with no prompt to answer again)."""
        parent = None if msg.parent_id is None else self.chats.find(msg.parent_id)
        if parent is None:
            self.notify(hint)
        return parent

    def action_prev_branch(self, msg_id: str | None = None) -> None:
        """[ or ‹: show the message's previous sibling and the branch under it."""
        self._switch(-1, msg_id)

    def action_next_branch(self, msg_id: str | None = None) -> None:
        """] or ›: show the message's next sibling and the branch under it."""
        self._switch(1, msg_id)

    def _switch(self, step: int, msg_id: str | None) -> None:
        msg = None if self.is_closing or self._busy() else self._target(msg_id)
        if msg is not None:
            target = self.chats.switch(msg.id, step)
            self.open_conversation(self.conv_id, focus_id=target.id)

    def action_delete_branch(self, msg_id: str | None = None) -> None:
        """d, or a message's `delete`: ask, then (d again) remove it and everything under it."""
        msg = None if self.is_closing or self._busy() else self._target(msg_id)
        if msg is None:
            return
        what = "this reply" if msg.role == "assistant" else "this message"
        num_under = self.chats.num_under(msg.id)
        if num_under:
            s = "" if num_under == 1 else "s"
            what += f" and the {num_under} message{s} under it (every branch)"
        if not self._confirmed(("branch", msg.id), f"Delete {what}? Press d again to delete."):
            return
        # focus what takes its place: the sibling shown instead, else its parent, else the box
        others = [m.id for m in self.chats.siblings(msg.id) if m.id != msg.id]
        self.chats.delete_branch(msg.id)
        focus_id = others[-1] if others else msg.parent_id
        self.open_conversation(self.conv_id, focus_id=focus_id)
        if focus_id is None:
            self._focus_composer()
        self.notify("Branch deleted.")
