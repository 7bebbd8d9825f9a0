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
TOO_LONG_HINT = "edit a message (e) to make it shorter, or start a new chat (Ctrl+N)"
GONE = "{} was deleted by another statechat process on this cache dir."
COMPOSER_ROWS = 12  # the message box's most rows (app.tcss says the same)
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
        self.query_one("#banner").display = is_embedded(self.loaded.path)
        convs = self.chats.conversations()
        self.open_conversation(convs[0].id if convs else None)
        self.query_one(Composer).focus()

    def on_resize(self, event: events.Resize) -> None:
        """The message box grows with its lines: to COMPOSER_ROWS, or a third of a small
        terminal."""
        rows = max(3, min(COMPOSER_ROWS, event.size.height // 3))
        self.query_one(Composer).styles.max_height = rows

    def on_unmount(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.chats is not None:
            self.chats.close()

    # --- showing ------------------------------------------------------------------------
    def open_conversation(self, conv_id: str | None, focus_id: str | None = None) -> None:
        """Show `conv_id`'s current branch (None: a new chat) and the list of chats."""
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
        chat.show(views)
        if focus_id:
            self.call_after_refresh(lambda: (v := chat.view_of(focus_id)) and v.focus())

    def on_conversation_list_open(self, event: ConversationList.Open) -> None:
        self.open_conversation(event.conv_id)
        self.query_one(Composer).focus()

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

    def start_reply(self, parent: Message) -> None:
        """Add a reply under `parent` and stream the model's answer into it; a prompt the engine
        refuses gets a reply whose status line says why."""
        # a reply that failed before any text (its status says why) was never the model's turn
        history = [m.as_chat() for m in self.chats.path(parent.id)
                   if not (m.role == "assistant" and not m.content and m.stats.get("error"))]
        try:
            ids = self.worker.render(history, template_kwargs=self.template_kwargs)
            room = self.worker.max_model_len - len(ids)
            params = dataclasses.replace(self.sampling, max_tokens=max(1, min(self.sampling.max_tokens, room)))
            handle = self.worker.submit(ids, params)
        except StatechatError as e:
            error = f"{e}; {TOO_LONG_HINT}" if isinstance(e, ContextLengthError) else str(e)
            self.chats.add(self.conv_id, parent.id, "assistant", "", stats={"error": error})
            self.open_conversation(self.conv_id)
            return
        self.handle, self.streaming_conv_id = handle, self.conv_id
        reply = self.chats.add(self.conv_id, parent.id, "assistant", "")
        self.open_conversation(self.conv_id)
        self.stream_reply(handle, reply.id)

    @work(thread=True, exit_on_error=False)
    def stream_reply(self, handle, reply_id: str) -> None:
        text, shown, start = "", 0.0, time.perf_counter()
        stats: dict = {}
        try:
            for event in handle:
                text += event.text
                if time.perf_counter() - shown > STREAM_INTERVAL_S:
                    shown = time.perf_counter()
                    self.call_from_thread(self._show_text, reply_id, text)
            stats = reply_stats(handle.output, time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - shown on the reply, the app stays up
            stats = {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}
        self.call_from_thread(self._finish_reply, reply_id, text, stats)

    def _show_text(self, reply_id: str, text: str) -> None:
        view = self.query_one(ChatView).view_of(reply_id)
        if view is not None:
            view.set_text(text)

    def _finish_reply(self, reply_id: str, text: str, stats: dict) -> None:
        self.handle = self.streaming_conv_id = None
        if self.chats.find(reply_id) is None:  # deleted by another process meanwhile
            return
        self.chats.update(reply_id, content=text, stats=stats)
        view = self.query_one(ChatView).view_of(reply_id)
        if view is not None:
            view.message = self.chats.message(reply_id)
            view.set_text(text)
            view.set_status(status_line(stats))
        self.query_one(ConversationList).show(self.chats.conversations(), self.conv_id)

    # --- actions ------------------------------------------------------------------------
    def action_new_chat(self) -> None:
        self.open_conversation(None)
        self.query_one(Composer).focus()

    def action_stop(self) -> None:
        composer = self.query_one(Composer)
        if self.handle is not None:
            self.handle.abort()
        elif composer.editing:
            composer.end_edit()

    def action_focus_list(self) -> None:
        self.query_one(ConversationList).focus()

    def action_focus_input(self) -> None:
        self.query_one(Composer).focus()

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
        self.start_reply(msg if msg.role == "user" else self.chats.message(msg.parent_id))

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
        if msg is not None:
            self.chats.delete_branch(msg.id)
            self.open_conversation(self.conv_id)
            self.notify("Branch deleted.")
