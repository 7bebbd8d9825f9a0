"""StatechatApp: conversations on the left, the open branch in the middle, the input below.

The app is put together from one mixin per concern: layout.py (fitting the terminal, moving
focus), conversations.py (opening chats; editing, regenerating, switching and deleting
branches), replies.py (sending a message, streaming its reply), system_prompt.py (a chat's
system message), sharing.py (copying, exporting), renaming.py (a chat's name) and stopping.py
(Esc, and the reply streaming at exit). This module builds the screen, loads the engine in a
thread behind a progress screen, and closes everything when the app quits (Ctrl+Q; SIGTERM and
SIGHUP quit as it does). Conversations live in `<cache_dir>/index.db` (chat/tree.py): editing
or regenerating adds a branch, nothing is overwritten.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections import deque
from pathlib import Path
from typing import ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Static

from statechat.chat.tree import ChatStore, open_chats
from statechat.config import EngineConfig, flags_named
from statechat.engine.sampling import SamplingParams
from statechat.errors import StatechatError
from statechat.tui.conversations import ConversationsMixin
from statechat.tui.format import clean, sampling_line
from statechat.tui.layout import EMBEDDED_BANNER, LayoutMixin
from statechat.tui.log_notices import NOTICE_S, LogNotices, Warned
from statechat.tui.renaming import RenamingMixin
from statechat.tui.replies import NEW_REPLY, RepliesMixin
from statechat.tui.sharing import SharingMixin
from statechat.tui.stopping import StoppingMixin
from statechat.tui.system_prompt import SystemPromptMixin
from statechat.tui.typed_ahead import TypedAheadMixin
from statechat.tui.widgets.chat_view import ChatView
from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from statechat.tui.widgets.loading_screen import LoadingScreen

SHUTDOWN_S = 90  # the most a quit waits for the engine (its step, then the cache's writes)
# the app's own sampling, under the model's recommended sampling and `run`'s flags (cli.py)
DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=1024)
# the app's actions that run on the loading screen (Ctrl+Q, and Ctrl+C's hint to press it)
LOADING_ACTIONS = frozenset({"quit", "help_quit"})
# signals that quit as Ctrl+Q does, the exit status 128 + their number: `kill`, a closed terminal
QUIT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


class AppClosed(Exception):
    """The app quit while the engine was loading: the load stops."""


class StatechatApp(TypedAheadMixin, LayoutMixin, ConversationsMixin, RepliesMixin,
                   SystemPromptMixin, SharingMixin, RenamingMixin, StoppingMixin, App):
    """`statechat run`: chat with `config`'s model; conversations are kept in `chat_dir`.
    `loaded`: a model already loaded (tests), else the app loads `config.model`;
    `system_prompt`: the system message every chat begun in the session starts with."""

    CSS_PATH = "app.tcss"
    TITLE = "statechat"
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("escape", "stop", "Stop / cancel"),
        Binding("ctrl+l", "focus_list", "Chats"),
        Binding("ctrl+o", "focus_input", "Input"),
        Binding("ctrl+q", "quit", "Quit", priority=True),  # (Textual's is: it quits from a
        # modal screen too, the command palette)
    ]

    def __init__(self, config: EngineConfig, chat_dir: Path, loaded=None,
                 sampling: SamplingParams | None = None,
                 template_kwargs: dict | None = None, system_prompt: str | None = None) -> None:
        super().__init__()
        self.config, self.chat_dir, self.loaded = config, Path(chat_dir), loaded
        self.template_kwargs = template_kwargs  # variables of the model's chat template
        self.system_prompt = system_prompt  # new chats' first message (system_prompt.py)
        self.warmed_systems: set[tuple[int, ...]] = set()  # system prefixes computed
        self.sampling = sampling or DEFAULT_SAMPLING
        self.worker = None  # EngineWorker, once loaded
        self.chats: ChatStore | None = None
        self.conv_id: str | None = None
        self.viewed_saved: str | None = None  # the chat saved as viewed last (conversations.py)
        self.handle = None  # the RequestHandle being streamed
        self.streaming_conv_id: str | None = None  # the chat of the reply being streamed
        self.streaming_reply_id: str | None = None  # the reply being streamed
        self.streaming_thinking = False  # its prompt opened its reasoning (chat/template.py)
        self.streaming_start = NEW_REPLY  # what it began with (a continuation's: the reply it
        # continues)
        self.next_turn = None  # the engine request computing the next turn's prefix, if any
        # (next_turn.py)
        self.delete_asked: tuple[tuple[str, str], float] | None = None  # the delete asked
        # about (("chat" or "branch", id), when), done by its key again (conversations.py)
        self.delete_question = None  # the notice asking it (a textual Notification)
        self.is_embedded = False  # the random-weight model: its banner shows
        self.is_ready = False  # the engine and the chats are up, the chat shown
        self.is_closing = False  # set as the app quits: the load stops, late callbacks return
        self.is_closed = False  # everything the app opened is closed (the engine stopped)
        self._close_lock = threading.Lock()  # (orders the load's hand-over and the close)
        self.quit_signals: tuple[int, ...] = ()  # QUIT_SIGNALS, while the app handles them
        self._handlers_before: dict[int, object] = {}  # (theirs before the app took them)
        self.keys_held: deque = deque()  # keys that came while the one before was out,
        self.key_out = None  # its KeyDone, and the Timer that checks it was not lost
        self.key_watch = None  # (typed_ahead.py)
        self.log_notices = LogNotices(self)  # the engine's and cache's warnings, as notices;
        # those logged as it closes kept in `log_notices.late`, printed after it (`run`)

    def compose(self) -> ComposeResult:
        """The chat list | the banner, the branch shown and the message box."""
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
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """On the loading screen only quitting runs: the other keys' actions need the chats
        (Ctrl+N crashed the app), and a screen opened over it (Ctrl+P's command palette) was
        closed in its place when the load ended, leaving the app on the loading screen."""
        return self.is_ready or action in LOADING_ACTIONS

    def on_mount(self) -> None:
        """Handle QUIT_SIGNALS, show the loading screen and start the load behind it."""
        self._handle_quit_signals()
        self.log_notices.install()
        screen = LoadingScreen(str(self.config.model))
        self.push_screen(screen)
        self.load(screen)

    @work(thread=True, exit_on_error=False)
    def load(self, screen: LoadingScreen) -> None:
        """(A worker thread) load the model, build the engine and open the chats, moving
        `screen`'s bar; then show the chat, or end the app with one line on an error. Once the
        app quits (Ctrl+Q on this screen), it stops after the step under way: the process
        waits for that step, not for the rest (on a GPU, the engine's graph capture)."""
        try:
            self._build(screen)
            self.call_from_thread(self._engine_ready)
        except Exception as e:  # noqa: BLE001 - one line for the user, like the CLI
            if self.is_closing:  # (AppClosed, or an error with nobody left to tell)
                return
            what = str(e) if isinstance(e, StatechatError) else f"{type(e).__name__}: {e}"
            self.call_from_thread(self.exit, None, 2, f"statechat: {what}")

    def _build(self, screen: LoadingScreen) -> None:
        from statechat.engine.engine import LLMEngine
        from statechat.engine.worker import EngineWorker

        self._advance(screen, 1)
        if self.loaded is None:
            import torch

            from statechat.devices import default_dtype, resolve_device
            from statechat.model.loader import load_model

            device = resolve_device(self.config.device)
            dtype = (getattr(torch, self.config.dtype) if self.config.dtype
                     else default_dtype(device))
            self.loaded = load_model(self.config.model, dtype=dtype, device=device,
                                     chat_template=self.config.chat_template)
        self._advance(screen, 2)
        with flags_named():  # (its errors name the flags of `statechat run`)
            worker = EngineWorker(LLMEngine(self.config, loaded=self.loaded))
        self._adopt("worker", worker, worker.shutdown)
        self._advance(screen, 3)
        chats = open_chats(self.chat_dir)
        self._adopt("chats", chats, chats.close)
        self._advance(screen, 4)

    def _advance(self, screen: LoadingScreen, step: int) -> None:
        """(The load's thread) show its step; AppClosed once the app is closing."""
        if self.is_closing:
            raise AppClosed
        self.call_from_thread(screen.advance, step)

    def _adopt(self, name: str, part, close) -> None:
        """(The load's thread) hand a part it built to the app as attribute `name`, for
        `on_unmount` to close; once the app is closing, `close()` it here and raise
        AppClosed."""
        with self._close_lock:
            closing = self.is_closing
            if not closing:
                setattr(self, name, part)
        if closing:
            close()
            raise AppClosed

    def _engine_ready(self) -> None:
        from statechat.paths import is_embedded, served_name

        if self.is_closing:  # (the app quit as the load ended)
            return
        self.pop_screen()
        self.is_ready = True
        self.refresh_bindings()  # (the footer shows the keys that now run)
        # (a snapshot of the HF cache by its repo id, not its commit hash, as `serve` names it)
        self.sub_title = (f"{clean(served_name(self.loaded.path))} on {self.loaded.device.type} · "
                          f"{sampling_line(self.sampling)}")
        self.is_embedded = is_embedded(self.loaded.path)
        self._fit(self.size)
        self.open_conversation(self.first_chat())
        self._focus_composer()

    def run(self, *args, **kwargs):
        """Textual's `run`; then the warnings logged as the app closed (the cache's writes that
        failed, say), printed now that the terminal is the caller's again."""
        result = super().run(*args, **kwargs)
        for line in self.log_notices.late:
            print(line, file=sys.stderr)
        return result

    def on_warned(self, event: Warned) -> None:
        """A warning of the engine or the cache (log_notices.py), in a notice."""
        self.notify(event.text, severity="error" if event.is_error else "warning",
                    timeout=NOTICE_S, markup=False)

    # --- closing ------------------------------------------------------------------------
    def _handle_quit_signals(self) -> None:
        """Quit on QUIT_SIGNALS as on Ctrl+Q (Python's default ended the process: the reply
        streaming lost, the terminal left in the alternate screen). Only in the main thread:
        asyncio takes signals nowhere else, and the app then leaves them as they are. The
        handlers found are put back as the app closes (`_release_quit_signals`)."""
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for signum in QUIT_SIGNALS:
            self._handlers_before[signum] = signal.getsignal(signum)
            loop.add_signal_handler(signum, self.quit_on_signal, signum)
        self.quit_signals = QUIT_SIGNALS

    def _release_quit_signals(self) -> None:
        """Give QUIT_SIGNALS back to the handlers they had before the app. asyncio's removal
        leaves a signal's default action, which ended the process without the clean-up of
        whoever ran the app: `run`'s typeahead(), whose handler restores the terminal, lost
        its SIGTERM and SIGHUP from here until it ended (no echo, no line editing left)."""
        loop = asyncio.get_running_loop()
        for signum in self.quit_signals:
            loop.remove_signal_handler(signum)
            before = self._handlers_before.pop(signum, None)
            if before is not None:  # (None: set outside Python, it cannot be put back)
                signal.signal(signum, before)
        self.quit_signals = ()

    def quit_on_signal(self, signum: int) -> None:
        """Quit as Ctrl+Q does, with exit status 128 + `signum`; nothing once quitting."""
        if not self.is_closing:
            self.exit(return_code=128 + signum)

    def exit(self, *args, **kwargs) -> None:
        """Textual's `exit` (Ctrl+Q, an error), telling a load under way to stop at once: the
        app closes from here, and the load's thread would hold the process until it ends."""
        self._begin_closing()
        super().exit(*args, **kwargs)

    def _handle_exception(self, error: Exception) -> None:
        """(Textual's, for an error no handler caught: it ends the app with a traceback) a
        StatechatError, such as the chats' file found damaged, ends it in its one line, as a
        load's error does."""
        if isinstance(error, StatechatError) and not self.is_closing:
            self.exit(None, 2, f"statechat: {error}")
        else:
            super()._handle_exception(error)

    def _begin_closing(self) -> None:
        with self._close_lock:  # (from now on the load closes what it builds)
            self.is_closing = True

    def on_unmount(self) -> None:
        """Quit: stop the engine (a streaming reply is aborted and then kept, as Esc keeps it;
        the cache's pending writes finish), then close the chats. Nothing here waits on a
        fixed interval: the time is the engine's (the step under way, the cache writes)."""
        self._begin_closing()
        try:
            stopped = True
            if self.worker is not None:  # (it aborts a reply still streaming; the cache's
                # writes may take the store's 60 s and its writer's 10 s)
                stopped = self.worker.shutdown(timeout=SHUTDOWN_S)
            if self.handle is not None and stopped:  # (else the engine still runs: not read)
                self._keep_stopped_reply()
            if self.chats is not None:
                self.chats.close()
            self.is_closed = stopped
        finally:  # (a close that raised left the handler, holding the app, on the logger)
            self.log_notices.remove()
            self._release_quit_signals()  # (a signal during the close waited for its end)
