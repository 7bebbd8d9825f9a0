"""ChatView: the scrolling branch of the open conversation."""

from __future__ import annotations

import asyncio
from typing import ClassVar

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widget import AwaitMount
from textual.worker import WorkerState

from statechat.tui.widgets.message_view import MessageView

SETTLE_FRAMES = 50  # the most screen refreshes a chat waits for its new views to be laid out


class ChatView(VerticalScroll, can_focus=False):
    """Holds one MessageView per message of the branch; up/down move between them.

    Not focusable itself, so Shift-Tab from the input lands on the last message.
    """

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("up,k", "move(-1)", "Prev msg", show=False),
        Binding("down,j", "move(1)", "Next msg", show=False),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # the views shown: those replaced stay in the DOM a moment, and a streamed update
        # sent to one of them would be lost
        self.shown: list[MessageView] = []
        self.settling = None  # the worker that waits for the views shown to be built (`show`)
        self.held_for: MessageView | None = None  # the view focused the chat last stood
        # still for (`hold_for_reader`), until the focus moves
        self.growing_id: str | None = None  # the message whose view grows at its end (the
        # reply streaming), if it is shown

    def on_mount(self) -> None:
        """Anchor to the bottom: the view stays scrolled there while a reply grows."""
        self.anchor()

    def show(self, views: list[MessageView], growing_id: str | None = None) -> None:
        """Show `views` in place of the views shown, scrolled to the bottom, or, where one of
        them is focused, to it once they are built (`_settle`), unless it is the view of
        `growing_id` (the reply streaming: its end, where it grows, is at the bottom; a
        continuation of a long reply showed the reply's top, its new text streaming out of
        sight below). The views shown that begin the
        same (each `shows_as` the one of `views` in its place: a branch switched below them)
        are kept, not built again (300 messages took 2 s); those after the first that differs
        are replaced by the rest of `views`."""
        num_kept = 0
        for old, new in zip(self.shown, views):
            if not old.shows_as(new):
                break
            num_kept += 1
        if num_kept < len(self.shown):
            self.remove_children(self.shown[num_kept:])
        self.mount_all(views[num_kept:])
        self.shown = self.shown[:num_kept] + views[num_kept:]
        self.growing_id = growing_id
        self.anchor()
        self.settling = self.run_worker(self._settle(), group="settle", exclusive=True)

    @property
    def is_settling(self) -> bool:
        """Whether views shown are still being built, or the scroll that follows their build
        has not run yet."""
        return self.settling is not None and self.settling.state in (
            WorkerState.PENDING, WorkerState.RUNNING)

    async def _settle(self) -> None:
        """Once every view shown is built and laid out, scroll the focused one, if it is one of
        them, into sight. Only then are their heights known: a view focused, or moved to
        (Up, Down), while they are built (a busy machine, a long chat) seemed in sight in a
        chat of no height, and the chat, left anchored to its bottom, went there once they had
        their heights, the focused message out of sight. (A worker: the next `show` cancels
        this one, and waits for every view it shows.)"""
        await AwaitMount(self, [v for v in self.views() if not v.is_mounted])
        for _ in range(SETTLE_FRAMES):  # (a loaded machine lays the views out some frames
            # after they are built; a chat not shown, as on a narrow terminal listing the
            # chats, never does)
            refreshed = asyncio.Event()
            self.call_after_refresh(refreshed.set)
            await refreshed.wait()
            if all(v.size.height for v in self.shown):
                break
        if not self.is_attached:  # (the app is closing)
            return
        focused = self.screen.focused
        if (focused in self.shown and focused.message.id != self.growing_id
                and not self.screen.can_view_entire(focused)):
            # (at once, not animated: the layout is done, and an animation could outlive the
            # app's loop, which a quit then waits on: test_bench_switch.py)
            self.screen.scroll_to_center(focused, animate=False, origin_visible=True,
                                         immediate=True)

    def hold_for_reader(self, growing: MessageView) -> None:
        """Call before `growing` (the streaming reply) grows: while another view, in sight, has
        focus (the user reads it), the chat stops following its bottom, and stays where it is
        (it followed the reply, and pushed the message read out of sight). Once scrolled back
        to its bottom (End, the wheel), it follows again (Textual's anchor), the message read
        in sight or not, until the focus moves (it stopped again at once while the message was
        still in sight: End did nothing)."""
        focused = self.screen.focused
        if (self.is_anchored and focused in self.shown and focused is not growing
                and focused is not self.held_for and self.can_view_partial(focused)):
            self.held_for = focused
            self.release_anchor()

    def on_descendant_focus(self) -> None:
        """A view focused anew: the chat may stand still for it (`hold_for_reader`)."""
        self.held_for = None

    def views(self) -> list[MessageView]:
        """The views shown, first to last (not those being replaced)."""
        return list(self.shown)

    def view_of(self, msg_id: str) -> MessageView | None:
        """The view shown for message `msg_id`, if any."""
        return next((v for v in self.views() if v.message.id == msg_id), None)

    def action_move(self, step: int) -> None:
        """Up/down: focus the message `step` away from the focused one (from the box: the
        last), scrolled into view. The focus moves now, not after the keys already queued
        (`Widget.focus` waits for them): a held or fast-typed Up moved one message, not one
        per key."""
        views = self.views()
        if not views:
            return
        focused = self.screen.focused
        i = views.index(focused) if focused in views else (len(views) if step < 0 else -1)
        target = views[max(0, min(len(views) - 1, i + step))]
        self.screen.set_focus(target)
        self.scroll_to_widget(target, animate=False)
