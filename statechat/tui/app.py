"""StatechatApp: conversations on the left, the open branch in the middle, the input below.

The engine loads in a thread behind a progress screen; each reply streams from a
`@work(thread=True)` worker reading an EngineWorker handle and updating the screen with
`call_from_thread`. Conversations live in `<cache_dir>/index.db` (chat/tree.py): editing or
regenerating adds a branch, nothing is overwritten.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import ClassVar

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Static

from statechat.chat.tree import ChatStore, Message, open_chats
from statechat.config import EngineConfig, flags_named
from statechat.engine.sampling import SamplingParams
from statechat.errors import ContextLengthError, StatechatError
from statechat.tui.format import one_line, reply_stats, sampling_line, status_line
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from statechat.tui.widgets.loading_screen import LoadingScreen
from statechat.tui.widgets.message_view import MessageView

EMBEDDED_BANNER = (
    "Embedded tiny Qwen3.5 with RANDOM weights: replies are noise, the cache at work is real. "
    "For real answers: hf download Qwen/Qwen3.5-9B --local-dir ~/models/Qwen3.5-9B, then "
    "statechat run --model ~/models/Qwen3.5-9B"
)
SHORT_BANNER = "Tiny model, RANDOM weights: replies are noise (statechat run --model DIR)"
TOO_LONG_HINT = "edit a message (e) to make it shorter, or start a new chat (Ctrl+N)"
GONE = "{} was deleted by another statechat process on this cache dir."
COMPOSER_ROWS = 12  # the message box's most rows (app.tcss says the same)
SIDEBAR_COLUMNS = (16, 28)  # the chat list's width: a third of the terminal, within these
NARROW_COLUMNS = 50  # a terminal narrower shows the chat list only while it has focus (Ctrl+L)
BANNER_ROWS = 16  # a terminal shorter hides the banner
BANNER_COLUMNS = 128  # one narrower shows SHORT_BANNER (the long one would take 4+ rows)
BARS_ROWS = 10  # a terminal shorter hides the header and the footer too
STREAM_INTERVAL_S = 0.05  # screen updates while streaming, at most this often
# the app's own sampling, under the model's recommended sampling and `run`'s flags (cli.py)
DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=1024)


class StatechatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "statechat"
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("escape", "stop", "Stop / cancel"),
        Binding("ctrl+l", "focus_list", "Chats"),
        Binding("ctrl+o", "focus_input", "Input"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, config: EngineConfig, chat_dir: Path, loaded=None,
                 sampling: SamplingParams | None = None, template_kwargs: dict | None = None) -> None:
        super().__init__()
        self.config, self.chat_dir, self.loaded = config, Path(chat_dir), loaded
        self.template_kwargs = template_kwargs  # variables of the model's chat template
        self.sampling = sampling or DEFAULT_SAMPLING
        self.worker = None  # EngineWorker, once loaded
        self.chats: ChatStore | None = None
        self.conv_id: str | None = None
        self.handle = None  # the RequestHandle being streamed
        self.streaming_conv_id: str | None = None  # the chat of the reply being streamed
        self.streaming_reply_id: str | None = None  # the reply being streamed
        self.is_embedded = False  # the random-weight model: its banner shows

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            conversations = ConversationList(id="conversations")
            conversations.border_title = "Chats"
            yield conversations
            with Vertical(id="main"):
                yield Static(EMBEDDED_BANNER, id="banner", markup=False)
                yield ChatView(id="chat")
                yield Composer()
        yield Footer()

    # --- start-up -----------------------------------------------------------------------
    def on_mount(self) -> None:
        screen = LoadingScreen(str(self.config.model))
        self.push_screen(screen)
        self.load(screen)

    @work(thread=True, exit_on_error=False)
    def load(self, screen: LoadingScreen) -> None:
        try:
            from statechat.engine.engine import LLMEngine
            from statechat.engine.worker import EngineWorker

            self.call_from_thread(screen.advance, 1)
            if self.loaded is None:
                import torch

                from statechat.devices import default_dtype, resolve_device
                from statechat.model.loader import load_model

                device = resolve_device(self.config.device)
                dtype = getattr(torch, self.config.dtype) if self.config.dtype else default_dtype(device)
                self.loaded = load_model(self.config.model, dtype=dtype, device=device)
            self.call_from_thread(screen.advance, 2)
            with flags_named():  # (its errors name the flags of `statechat run`)
                self.worker = EngineWorker(LLMEngine(self.config, loaded=self.loaded))
            self.call_from_thread(screen.advance, 3)
            self.chats = open_chats(self.chat_dir)
            self.call_from_thread(screen.advance, 4)
        except Exception as e:  # noqa: BLE001 - one line for the user, like the CLI
            what = str(e) if isinstance(e, StatechatError) else f"{type(e).__name__}: {e}"
            self.call_from_thread(self.exit, None, 2, f"statechat: {what}")
            return
        self.call_from_thread(self._engine_ready)

    def _engine_ready(self) -> None:
        from statechat.paths import is_embedded

        self.pop_screen()
        self.sub_title = (f"{self.loaded.path.name} on {self.loaded.device.type} · "
                          f"{sampling_line(self.sampling)}")
        self.is_embedded = is_embedded(self.loaded.path)
        self._fit(self.size)
        convs = self.chats.conversations()
        self.open_conversation(convs[0].id if convs else None)
        self._focus_composer()

    def on_resize(self, event: events.Resize) -> None:
        self._fit(event.size)

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        if isinstance(event.widget, ConversationList):  # (it fills a narrow terminal)
            self._fit(self.size)

    def on_descendant_blur(self, event: events.DescendantBlur) -> None:
        if isinstance(event.widget, ConversationList):  # (hidden again on a narrow terminal)
            self._fit(self.size)

    def _fit(self, size) -> None:
        """Leave a small terminal's rows and columns to the messages and the box: the box grows
        with its lines to COMPOSER_ROWS or a third of the rows, the chat list takes a third of
        the columns (a narrow terminal shows either the list, while it has focus, or the chat),
        the banner shortens or hides, and on very few rows the header and footer hide."""
        width, height = size
        self.query_one(Composer).styles.max_height = max(3, min(COMPOSER_ROWS, height // 3))
        chats = self.query_one(ConversationList)
        narrow = width < NARROW_COLUMNS
        low, high = SIDEBAR_COLUMNS
        chats.styles.width = "1fr" if narrow else max(low, min(high, width // 3))
        chats.display = not narrow or chats.has_focus
        self.query_one("#main").display = not (narrow and chats.has_focus)
        banner = self.query_one("#banner", Static)
        banner.display = self.is_embedded and height >= BANNER_ROWS
        banner.update(EMBEDDED_BANNER if width >= BANNER_COLUMNS else SHORT_BANNER)
        for bar in (self.query_one(Header), self.query_one(Footer)):
            bar.display = height >= BARS_ROWS

    def on_unmount(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()  # (it aborts a reply still streaming)
        if self.handle is not None:
            self._keep_stopped_reply()
        if self.chats is not None:
            self.chats.close()

    def _keep_stopped_reply(self) -> None:
        """At exit, save the reply that was streaming (the engine is shut down: its sequence
        holds the last of it) as Esc leaves one: its text so far and a 'stopped' status. Its
        stream's own `_finish_reply`, too late now, does nothing."""
        handle, reply_id = self.handle, self.streaming_reply_id
        self.handle = self.streaming_conv_id = self.streaming_reply_id = None
        if handle.seq is None:  # (the engine refused it: it never began)
            text, stats = "", {"error": "statechat quit before the reply began"}
        else:
            output = self.worker.engine.output(handle.seq)
            text = output.text
            reason = output.finish_reason or "abort"  # (the engine did not stop in time)
            stats = reply_stats(dataclasses.replace(output, finish_reason=reason))
        self._save_reply(reply_id, text, stats)

    # --- showing ------------------------------------------------------------------------
    def open_conversation(self, conv_id: str | None, focus_id: str | None = None) -> None:
        """Show `conv_id`'s current branch (None: a new chat) and the list of chats; with
        `focus_id`, focus that message's view once it is built (the focused view is replaced)."""
        if conv_id is not None and not self.chats.has_conversation(conv_id):
            self.notify(GONE.format("That chat"), severity="warning")
            conv_id = None
        self.conv_id = conv_id
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
        for msg in branch:
            sibs = self.chats.siblings(msg.id)
            pos = next(i for i, s in enumerate(sibs) if s.id == msg.id) + 1
            views.append(MessageView(msg, pos, len(sibs)))
        chat = self.query_one(ChatView)
        if focus_id and isinstance(self.focused, MessageView):  # (the box holds focus until
            # the view is built: a key meanwhile must not reach the chat list, where Delete
            # deletes the chat)
            composer.focus()
        chat.show(views)
        if focus_id:
            self.call_after_refresh(lambda: (v := chat.view_of(focus_id)) and v.focus())

    def on_conversation_list_open(self, event: ConversationList.Open) -> None:
        self.open_conversation(event.conv_id)
        self._focus_composer()

    def on_conversation_list_delete(self, event: ConversationList.Delete) -> None:
        if self.handle is not None and event.conv_id == self.streaming_conv_id:
            self.notify("Its reply is streaming: stop it (Esc) before deleting this chat.",
                        severity="warning")
            return
        self.chats.delete_conversation(event.conv_id)
        self.open_conversation(None if event.conv_id == self.conv_id else self.conv_id)

    def _target(self, msg_id: str | None) -> Message | None:
        """The message an action is for: the one clicked, else the focused one."""
        if msg_id is None:
            focused = self.focused
            if not isinstance(focused, MessageView):
                return None
            msg_id = focused.message.id
        msg = self.chats.find(msg_id)
        if msg is None:
            self.notify(GONE.format("That message"), severity="warning")
            self.open_conversation(self.conv_id)
        return msg

    def _busy(self) -> bool:
        """Whether a reply streams (the user is told): sending and changing branches wait."""
        if self.handle is not None:
            self.notify("A reply is streaming; press Esc to stop it first.", severity="warning")
        return self.handle is not None

    # --- sending and streaming ----------------------------------------------------------
    def on_composer_submitted(self, event: Composer.Submitted) -> None:
        composer = self.query_one(Composer)
        if not event.text.strip():
            return
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
        if composer.editing:
            parent = edited.parent_id
        else:
            branch = self.chats.branch(self.conv_id) if self.conv_id else []
            parent = branch[-1].id if branch else None
        if self.conv_id is None:
            self.conv_id = self.chats.create(title=one_line(text)[:48]).id
        composer.take(event.text)
        self.start_reply(self.chats.add(self.conv_id, parent, "user", text))

    def start_reply(self, parent: Message, focus: bool = False) -> None:
        """Add a reply under `parent` and stream the model's answer into it; a prompt the engine
        refuses gets a reply whose status line says why. With `focus`, the reply is focused (a
        regenerate: keys go on acting on it)."""
        # a reply with no text (one that failed, or was stopped before its first token) was
        # never the model's turn: an empty assistant turn would teach the model to say nothing
        history = [m.as_chat() for m in self.chats.path(parent.id)
                   if not (m.role == "assistant" and not m.content)]
        try:
            ids = self.worker.render(history, template_kwargs=self.template_kwargs)
            room = self.worker.max_model_len - len(ids)
            params = dataclasses.replace(self.sampling, max_tokens=max(1, min(self.sampling.max_tokens, room)))
            handle = self.worker.submit(ids, params)
        except StatechatError as e:
            error = f"{e}; {TOO_LONG_HINT}" if isinstance(e, ContextLengthError) else str(e)
            reply = self.chats.add(self.conv_id, parent.id, "assistant", "", stats={"error": error})
            self.open_conversation(self.conv_id, focus_id=reply.id if focus else None)
            return
        reply = self.chats.add(self.conv_id, parent.id, "assistant", "")
        self.handle, self.streaming_conv_id = handle, self.conv_id
        self.streaming_reply_id = reply.id
        self.open_conversation(self.conv_id, focus_id=reply.id if focus else None)
        self.stream_reply(handle, reply.id)

    @work(thread=True, exit_on_error=False)
    def stream_reply(self, handle, reply_id: str) -> None:
        text, shown = "", 0.0
        stats: dict = {}
        try:
            for event in handle:
                text += event.text
                if time.perf_counter() - shown > STREAM_INTERVAL_S:
                    shown = time.perf_counter()
                    self.call_from_thread(self._show_text, reply_id, text)
            stats = reply_stats(handle.output)
        except Exception as e:  # noqa: BLE001 - shown on the reply, the app stays up
            stats = {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}
        self.call_from_thread(self._finish_reply, reply_id, text, stats)

    def _show_text(self, reply_id: str, text: str) -> None:
        view = self.query_one(ChatView).view_of(reply_id)
        if view is not None:
            view.set_text(text)

    def _finish_reply(self, reply_id: str, text: str, stats: dict) -> None:
        if reply_id != self.streaming_reply_id:  # (saved at exit already)
            return
        self.handle = self.streaming_conv_id = self.streaming_reply_id = None
        if not self._save_reply(reply_id, text, stats):
            return
        view = self.query_one(ChatView).view_of(reply_id)
        if view is not None:
            view.message = self.chats.message(reply_id)
            view.set_text(text)
            view.set_status(status_line(stats))
        self.query_one(ConversationList).show(self.chats.conversations(), self.conv_id)

    def _save_reply(self, reply_id: str, text: str, stats: dict) -> bool:
        """Store a reply's text and stats; False if another statechat deleted it meanwhile."""
        if self.chats.find(reply_id) is None:
            return False
        self.chats.update(reply_id, content=text, stats=stats)
        return True

    # --- actions ------------------------------------------------------------------------
    def action_new_chat(self) -> None:
        self.open_conversation(None)
        self._focus_composer()

    def action_stop(self) -> None:
        """Esc: cancel an edit first (its box is what the user is looking at), else stop the
        streaming reply."""
        composer = self.query_one(Composer)
        if composer.editing:
            composer.end_edit()
        elif self.handle is not None:
            self.handle.abort()

    def _focus_composer(self) -> None:
        self.query_one("#main").display = True  # (hidden while the list fills a narrow terminal)
        self.query_one(Composer).focus()

    def action_focus_list(self) -> None:
        chats = self.query_one(ConversationList)
        chats.display = True  # (a narrow terminal hides it while it is not focused)
        chats.focus()

    def action_focus_input(self) -> None:
        self._focus_composer()

    def action_edit_message(self, msg_id: str | None = None) -> None:
        msg = self._target(msg_id)
        if msg is None or msg.role != "user":
            self.notify("Pick one of your messages to edit (r regenerates a reply).")
            return
        self.query_one(Composer).start_edit(msg.id, msg.content)

    def action_regenerate(self, msg_id: str | None = None) -> None:
        if self._busy():
            return
        msg = self._target(msg_id)
        if msg is None:
            self.notify("Pick a reply to regenerate.")
            return
        parent = msg if msg.role == "user" else self.chats.message(msg.parent_id)
        self.start_reply(parent, focus=True)

    def action_prev_branch(self, msg_id: str | None = None) -> None:
        self._switch(-1, msg_id)

    def action_next_branch(self, msg_id: str | None = None) -> None:
        self._switch(1, msg_id)

    def _switch(self, step: int, msg_id: str | None) -> None:
        msg = None if self._busy() else self._target(msg_id)
        if msg is not None:
            target = self.chats.switch(msg.id, step)
            self.open_conversation(self.conv_id, focus_id=target.id)

    def action_delete_branch(self, msg_id: str | None = None) -> None:
        msg = None if self._busy() else self._target(msg_id)
        if msg is None:
            return
        # focus what takes its place: the sibling shown instead, else its parent, else the box
        others = [m.id for m in self.chats.siblings(msg.id) if m.id != msg.id]
        self.chats.delete_branch(msg.id)
        focus_id = others[-1] if others else msg.parent_id
        self.open_conversation(self.conv_id, focus_id=focus_id)
        if focus_id is None:
            self._focus_composer()
        self.notify("Branch deleted.")
