"""Sending a message and streaming the model's reply into it (RepliesMixin); a continuation
(c) streams the same way, beginning with the text of the reply it continues (chat/continuing.py).

A reply streams from a `@work(thread=True)` worker that reads an EngineWorker handle and
updates the screen with `call_from_thread`, at most every STREAM_INTERVAL_S; it is saved with
its stats (TTFT, decode rate, prefix reused) and the token ids its text was made of when it
ends, and every SAVE_INTERVAL_S before, as unfinished (so that a crash keeps what was shown).
Esc stops it; a reply streaming when the app quits is kept as Esc keeps it (stopping.py,
`_keep_stopped_reply`). One reply streams at a time. Once the app is quitting (`is_closing`),
Enter sends nothing and the screen is left alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sqlite3
import time

from textual import work

from statechat.chat.continuing import Start, continued_text, reply_start, text_token_ids
from statechat.chat.next_turn import warm_next_turn
from statechat.chat.template import ROLES, TOOL_ROLE, opens_thinking
from statechat.chat.tree import UNFINISHED, BusyError, DamagedError, GoneError, Message
from statechat.errors import ConfigError, ContextLengthError, StatechatError, first_line
from statechat.tui.conversations import GONE
from statechat.tui.format import chat_title, reply_stats, status_line
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList

TOO_LONG_HINT = "edit a message (e) to make it shorter, or start a new chat (Ctrl+N)"
STREAM_INTERVAL_S = 0.05  # screen updates while streaming, at most this often
SAVE_INTERVAL_S = 2.0  # a streaming reply's text saved this often (a crash keeps it)
NEW_REPLY = Start()  # what a reply that continues none begins with: nothing


class RepliesMixin:
    """StatechatApp's sending and streaming. The app has `worker` (the EngineWorker), `chats`,
    `conv_id`, `sampling`, `template_kwargs`, `next_turn`, the streaming reply's `handle`,
    `streaming_conv_id`, `streaming_reply_id` (None while none streams), `streaming_start` and
    `streaming_thinking`, `is_closing`, `open_conversation()` and `focused_message()`
    (conversations.py), and `begin_chat()`, `send_system_edit()` and `warm_system_prefix()`
    (system_prompt.py)."""

    def on_composer_submitted(self, event: Composer.Submitted) -> None:
        """Enter in the box: send its text (an edit's as a new branch beside the edited
        message) and stream the reply; nothing while a reply streams, or once quitting (Enter
        and Ctrl+Q queued together: the exit is removing the widgets)."""
        if self.is_closing or not event.text.strip():
            return
        composer = self.query_one(Composer)
        # blank lines around the text go, the first line's indent stays (pasted code)
        text = re.sub(r"^\s*\n", "", event.text.rstrip())
        if self._busy():
            return
        edited = self.chats.find(composer.editing) if composer.editing else None
        gone = self.conv_id is not None and not self.chats.has_conversation(self.conv_id)
        if gone or (composer.editing and edited is None):  # deleted by another statechat
            composer.end_edit(keep=True)  # (the text stays; Enter again sends it anew)
            if not gone:
                self.notify(GONE.format("The message being edited"), severity="warning")
            self.open_conversation(self.conv_id)  # (it says so of a chat gone)
            return
        if edited is not None and edited.role == "system":  # (a new branch: no reply)
            return self.send_system_edit(edited, event.text, text)
        if composer.editing:
            parent = edited.parent_id
        else:  # (the last message shown: another statechat may have gone on with this chat)
            shown = self.query_one(ChatView).views()
            parent = shown[-1].message.id if shown else None
        if self.conv_id is None:  # (with the session's system message; the text stays in
            is_made, parent = self.begin_chat(text)  # the box where it fails)
            if not is_made:
                return
        user = self._add(parent, "user", text)
        if user is not None:  # (else the text stays in the box: Enter again sends it anew)
            composer.take(event.text)
            self.start_reply(user)

    def start_reply(self, parent: Message, focus: bool = False, start: Start = NEW_REPLY) -> None:
        """Add a reply under `parent` and stream the model's answer into it; a prompt the engine
        refuses gets a reply whose status line says why. With `focus`, the reply is focused (a
        regenerate: keys go on acting on it). `start`: what the reply begins with (a
        continuation's: the reply it continues, whose ids end the prompt and whose text the new
        reply shows first)."""
        # a reply with no text (one that failed, or was stopped before its first token) was
        # never the model's turn: an empty assistant turn would teach the model to say nothing
        path = self.chats.path(parent.id)
        history = [m.as_chat() for m in path if not (m.role == "assistant" and not m.content)]
        try:
            check_roles(path)
            ids = self.worker.render(history, template_kwargs=self.template_kwargs)
            self.warm_system_prefix(history, ids)  # (a first turn: system_prompt.py)
            with self.worker.tokenizer_lock:  # (shared with the stream's thread)
                thinking = opens_thinking(self.worker.engine.tokenizer, ids)
            ids += start.token_ids
            room = self.worker.max_model_len - len(ids)
            max_tokens = max(1, min(self.sampling.max_tokens, room))
            params = dataclasses.replace(self.sampling, max_tokens=max_tokens)
            handle = self.worker.submit(ids, params)
        except StatechatError as e:
            error = f"{e}; {TOO_LONG_HINT}" if isinstance(e, ContextLengthError) else str(e)
            reply = self._add(parent.id, "assistant", "", stats={"error": error})
            if reply is not None:
                self.open_conversation(self.conv_id, focus_id=reply.id if focus else None)
            return
        reply = self._add(parent.id, "assistant", start.text, stats=UNFINISHED)  # (until it ends)
        if reply is None:
            handle.abort()
            return
        self.handle, self.streaming_conv_id = handle, self.conv_id
        self.streaming_reply_id, self.streaming_start = reply.id, start
        self.streaming_thinking = thinking  # (its view shows its reasoning as such: format.py)
        self.open_conversation(self.conv_id, focus_id=reply.id if focus else None)
        self.stream_reply(handle, reply.id, history, start)

    def continuation_of(self, reply: Message) -> Start:
        """What a continuation of `reply` begins with: its text, and the token ids it was made
        of (chat/continuing.py)."""
        stored = self.chats.token_ids(reply.id)
        with self.worker.tokenizer_lock:  # (the tokenizer is shared with the stream's thread)
            start = reply_start(self.worker.engine.tokenizer, reply.content, stored,
                                self.worker.engine.loaded.config.vocab_size)
        return dataclasses.replace(start, of=reply.id)

    def _add(self, parent_id: str | None, role: str, content: str,
             stats: dict | None = None) -> Message | None:
        """Add a message to the open chat; None, said in a notice, when another statechat
        process deleted the chat or the message it answers meanwhile, or the chats' file
        cannot be written for now (a full disk; a reply's row: the chat is shown again, with
        the message it would answer, for r to ask anew). A first message in a chat whose
        messages were all deleted names it anew, as it named a new chat."""
        title = chat_title(content) if parent_id is None and role == "user" else None
        try:
            return self.chats.add(self.conv_id, parent_id, role, content, stats=stats,
                                  title=title)
        except BusyError as e:  # (a reply's: its message was saved, and is shown; r asks again)
            is_reply = role == "assistant"
            what = "The reply was not started" if is_reply else "Not sent"
            self.notify(f"{what}: {e}.", severity="error", markup=False)
            if is_reply:
                self.open_conversation(self.conv_id)
            return None
        except GoneError:
            if self.chats.has_conversation(self.conv_id):
                self.notify(GONE.format("The message it follows"), severity="warning")
            self.open_conversation(self.conv_id)  # (it says so of a chat gone)
            return None

    @work(thread=True, exit_on_error=False)
    def stream_reply(self, handle, reply_id: str, history: list[dict], start: Start) -> None:
        """(A worker thread) show `start`'s text, then `handle`'s after it as it grows, then
        save the reply; then have the engine compute the next turn's prefix where the reply's
        checkpoints do not hold it (next_turn.py)."""
        text, made, made_ids, shown = start.text, "", [], 0.0
        saved = time.perf_counter()
        stats: dict = {}
        token_ids = None
        try:
            for event in handle:
                made += event.text
                made_ids += event.token_ids
                text = self._continued(start, made, made_ids)
                if time.perf_counter() - shown > STREAM_INTERVAL_S:
                    shown = time.perf_counter()
                    self.call_from_thread(self._show_text, reply_id, text)
                if time.perf_counter() - saved > SAVE_INTERVAL_S:
                    saved = time.perf_counter()
                    self._save_unfinished(reply_id, text)
            stats = reply_stats(handle.output, len(start.token_ids), self.worker.max_model_len)
            token_ids = self._made_ids(start, handle.output, handle.params, text)
        except Exception as e:  # noqa: BLE001 - shown on the reply, the app stays up
            stats = {"error": first_line(e)}
        try:
            self.call_from_thread(self._finish_reply, reply_id, text, stats, token_ids, start)
        except DamagedError as e:  # (raised back into this thread, whose worker would drop it
            self.call_from_thread(self._handle_exception, e)  # unsaid: the app ends in its line)
            return
        except BusyError as e:  # (a full disk: the text so far stays on the screen)
            self.call_from_thread(self.notify, f"The reply was not saved: {e}.",
                                  severity="error", markup=False)  # (a path's [x] is no markup)
            return
        # (not once another reply began: it computes the same prefix itself)
        # (nor for a continuation that added nothing: its prefix is the reply's, done for it)
        if (not self.is_closing and self.handle is None and "error" not in stats
                and not start.adds_nothing(text, stats.get("finish_reason"))):
            with contextlib.suppress(StatechatError):  # (a quit under way, a refused prompt)
                self.next_turn = warm_next_turn(self.worker, history, text, handle.output,
                                                self.template_kwargs)

    def _save_unfinished(self, reply_id: str, text: str) -> None:
        """(The stream's thread) the reply so far, kept should the app die before it ends (a
        kill -9, a power cut); best effort: a save that fails leaves the stream alone."""
        chats = self.chats
        if chats is not None and not self.is_closing:
            with contextlib.suppress(StatechatError, sqlite3.Error):
                chats.save_unfinished(reply_id, text)

    def _show_text(self, reply_id: str, text: str) -> None:
        if self.is_closing:
            return
        chat = self.query_one(ChatView)
        view = chat.view_of(reply_id)
        if view is not None:
            chat.hold_for_reader(view)
            view.set_text(text)

    def _continued(self, start: Start, made: str, ids: list[int]) -> str:
        """The text of a reply begun with `start`, the engine's for the rest being `made` (of
        `ids`) so far (chat/continuing.py)."""
        def decode(some: list[int]) -> str:
            with self.worker.tokenizer_lock:  # (shared with the app's thread)
                return self.worker.engine.tokenizer.decode(some, skip_special_tokens=True)
        return continued_text(start, made, ids, decode)

    def _made_ids(self, start: Start, output, params, text: str) -> list[int] | None:
        """The token ids that `text`, of a reply begun with `start`, was made of, `output` the
        engine's for the request with sampling `params` that made the rest (None: unknown)."""
        stop_ids = self.worker.engine.eos_ids | set(params.stop_token_ids)
        with self.worker.tokenizer_lock:  # (the tokenizer is shared with the app's thread)
            return text_token_ids(self.worker.engine.tokenizer, output, stop_ids, start, text)

    def _finish_reply(self, reply_id: str, text: str, stats: dict, token_ids: list[int] | None,
                      start: Start = NEW_REPLY) -> None:
        if reply_id != self.streaming_reply_id:  # (saved at exit already)
            return
        stats = self._end_streaming(stats)
        if start.adds_nothing(text, stats.get("finish_reason")):
            self._drop_continuation(reply_id, start.of)
            return
        # (quitting: it is saved, with its stats, and the screen is left to the exit)
        is_saved = self._save_reply(reply_id, text, stats, token_ids)
        if self.is_closing:
            return
        chat = self.query_one(ChatView)
        view = chat.view_of(reply_id)
        saved = self.chats.find(reply_id) if is_saved else None  # (its text: `text`, as saved)
        if view is not None and saved is None:  # (another statechat deleted it, or its chat,
            # as it streamed or just after its save: it stayed, with no status line)
            if self.chats.has_conversation(self.conv_id):
                self.notify(GONE.format("The reply"), severity="warning")
            self.open_conversation(self.conv_id)  # (it says so of a chat gone)
        elif view is not None:
            chat.hold_for_reader(view)
            view.set_message(saved)
            view.set_status(status_line(stats))
        self.query_one(ConversationList).show(self.chats.conversations(), self.conv_id)

    def _drop_continuation(self, reply_id: str, continued_id: str) -> None:
        """A continuation that added nothing (Start.adds_nothing): deleted, rather than kept as
        a sibling that repeats reply `continued_id`, which is shown again (focused where the
        continuation was); one notice says so."""
        self._delete_continuation(reply_id, continued_id)
        if self.is_closing:
            return
        self.notify("The reply is already complete: nothing was added.")
        focused = self.focused_message()  # (a continuation's view is focused as it is shown,
        # built or not)
        self.open_conversation(self.conv_id,
                               focus_id=continued_id if focused == reply_id else focused)

    def _delete_continuation(self, reply_id: str, continued_id: str) -> None:
        """Delete continuation `reply_id` and select reply `continued_id`, where still there."""
        if self.chats.find(reply_id) is not None:
            self.chats.delete_branch(reply_id)
        if self.chats.find(continued_id) is not None:
            self.chats.select(continued_id)

    def _save_reply(self, reply_id: str, text: str, stats: dict,
                    token_ids: list[int] | None = None) -> bool:
        """Store a reply's text, stats and the token ids its text was made of (None: not
        known); False if another statechat deleted it meanwhile."""
        return self.chats.update(reply_id, content=text, stats=stats, token_ids=token_ids)

    def _end_streaming(self, stats: dict) -> dict:
        """No reply streams any more; `stats` of the one that did, with `thinking` where its
        prompt opened its reasoning (kept, so that it shows as such once it ended: a reply
        stopped, or cut at max tokens, inside its reasoning has no `</think>`)."""
        if self.streaming_thinking:
            stats = {**stats, "thinking": True}
        self.handle = self.streaming_conv_id = self.streaming_reply_id = None
        self.streaming_start, self.streaming_thinking = NEW_REPLY, False
        return stats

    def _busy(self) -> bool:
        """Whether a reply streams (the user is told): sending and changing branches wait."""
        if self.handle is not None:
            self.notify("A reply is streaming; press Esc to stop it first.", severity="warning")
        return self.handle is not None


def check_roles(path: list[Message]) -> None:
    """Raise ConfigError naming the first message of the branch `path` whose role no chat
    template takes (a row edited by hand; NULL reads as `unknown`), and how to go on."""
    for i, m in enumerate(path, 1):
        if m.role not in (*ROLES, TOOL_ROLE):
            raise ConfigError(f"message {i} of this branch has the role '{m.role}', which the "
                              "chat template does not take (a row edited by hand); edit a "
                              "message before it (e) or start a new chat (Ctrl+N)")
