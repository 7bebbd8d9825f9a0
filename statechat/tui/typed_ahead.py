"""Keys in the order typed (TypedAheadMixin): each key (or paste) acts where the keys before it
moved the focus, however fast they come (a burst the terminal sends at once: fast typing, or
keys pressed while the app was busy).

Textual hands a key to the focused widget (its own queue) and runs the app's and screen's
bindings once the key has bubbled back up to the app (the app's queue), while it hands the next
keys on meanwhile. So in a burst typed from the message box, Shift+Tab, Up, e sent e to the box
(typed into it) before Shift+Tab, on its way back, had moved the focus to a message. Here the
app hands on the next key only once the one before has been handled wherever it went, and the
messages it set off have come through (Enter on the chat list: the list's Selected, then its
Open, which opens the chat and focuses the box for the keys after it).
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widget import Widget

from statechat.tui.widgets.message_view import MessageView

TYPED = (events.Key, events.Paste)  # what waits for the key before it
MAX_ROUNDS = 8  # the most trips a KeyDone makes while the messages a key set off come through
LOST_CHECK_S = 0.1  # how often keys held back check that the key out was not lost


class KeyDone(Message):
    """Posted to `target`, the widget a key was handed to, just behind the key: it comes back
    up to the app after the key, once the widget and each part it bubbled through (the app's
    bindings last) have handled it."""

    def __init__(self, target: Widget, num_rounds: int = 1) -> None:
        super().__init__()
        self.target, self.num_rounds = target, num_rounds


def is_busy(widget: Widget) -> bool:
    """Whether `widget`, or a part above it (the app included), has a message to handle: one
    queued, or the next one, taken from the queue to be looked at (Textual combines some)."""
    return any(node.message_queue_size or getattr(node, "_pending_message", None) is not None
               for node in widget.ancestors_with_self)


class TypedAheadMixin:
    """StatechatApp's order of keys. The app has `keys_held` (a deque: keys that came while
    one was out), `key_out` (the KeyDone of the key out, None when none is) and `key_watch`
    (the Timer that checks for a key out lost, while keys are held)."""

    async def on_event(self, event: events.Event) -> None:
        """A key (or paste) that comes while the one before is out waits for it; else it is
        handled now (`_take`)."""
        if not isinstance(event, TYPED) or event.is_forwarded:
            await super().on_event(event)
            return
        self.keys_held.append(event)
        if self.key_out is None:
            await self._release()
        elif self.key_watch is None:
            self.key_watch = self.set_interval(LOST_CHECK_S, self._watch)

    async def on_key_done(self, message: KeyDone) -> None:
        """The key out has been handled: the keys held go on, once the messages it set off
        have come through too (none waits on the way from its widget to the app: else the
        KeyDone goes round again, behind them, up to MAX_ROUNDS times)."""
        if message is not self.key_out:
            return
        target = message.target
        if not (message.num_rounds < MAX_ROUNDS and target.is_attached and is_busy(target)
                and self._send_key_done(target, message.num_rounds + 1)):
            await self._release()

    async def _release(self) -> None:
        """Handle the keys held, in order, until one is out (handed to a widget)."""
        self.key_out = None
        while self.keys_held and self.key_out is None:
            await self._take(self.keys_held.popleft())
        if not self.keys_held and self.key_watch is not None:
            self.key_watch.stop()
            self.key_watch = None

    async def _take(self, event: events.Key | events.Paste) -> None:
        """Handle `event`: a key pressed while a message has focus acts at once through the
        bindings of the message, the chat and the app (a message takes no text; Textual's
        route, the message then the app, came after the next keys had gone to the message).
        Any other goes Textual's way (the app's priority bindings, else the focused widget),
        and is out until its KeyDone comes back (so does Esc on a message maximized, which
        Textual's way minimizes)."""
        focused = self.focused
        if isinstance(event, events.Key) and isinstance(focused, MessageView) and not (
                event.key == "escape" and self.screen.maximized is not None):  # (Textual's way:
            # Esc brings a message maximized back into the chat; the app's stop ran instead)
            if event.key == "escape":  # (as Textual's screen does with an Esc that passes it)
                self.screen.clear_selection()
            if await self._check_bindings(event.key, priority=True):
                return
            if await self._check_bindings(event.key):
                return
        target = focused or self.screen  # (where Textual's App.on_event hands it)
        await super().on_event(event)
        if event.is_forwarded:
            self._send_key_done(target)

    def _send_key_done(self, target: Widget, num_rounds: int = 1) -> bool:
        """Send a KeyDone behind what `target` has to handle: the key is out till it is back.
        False where `target` takes no more messages (it is closing)."""
        done = KeyDone(target, num_rounds)
        self.key_out = done if target.post_message(done) else None
        return self.key_out is not None

    def _watch(self) -> None:
        """(A timer's task) check, in the app's turn, that the key out was not lost."""
        self.call_later(self._check_lost, self.key_out)

    async def _check_lost(self, out: KeyDone | None) -> None:
        """A key handed to a widget removed before it came back (a message's view replaced as
        a reply ended), and its KeyDone with it: the keys held go on."""
        if out is not None and out is self.key_out and not out.target.is_attached:
            await self._release()
