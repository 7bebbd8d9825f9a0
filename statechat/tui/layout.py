"""Fitting the app to the terminal, and moving focus between its parts (LayoutMixin).

A small terminal leaves its rows and columns to the messages and the message box: the box, the
chat list, the banner, the header and the footer shrink or hide (sizes below, and app.tcss).
"""

from __future__ import annotations

from textual import events
from textual.widgets import Footer, Header, Static

from statechat.tui.widgets.composer import Composer
from statechat.tui.widgets.conversation_list import ConversationList
from statechat.tui.widgets.message_view import MessageView

EMBEDDED_BANNER = (
    "Embedded tiny Qwen3.5 with RANDOM weights: replies are noise, the cache at work is real. "
    "For real answers: hf download Qwen/Qwen3.5-9B --local-dir ~/models/Qwen3.5-9B, then "
    "statechat run --model ~/models/Qwen3.5-9B"
)
SHORT_BANNER = "Tiny model, RANDOM weights: replies are noise (statechat run --model DIR)"
COMPOSER_ROWS = 12  # the message box's most rows (app.tcss says the same)
SIDEBAR_COLUMNS = (16, 28)  # the chat list's width: a third of the terminal, within these
NARROW_COLUMNS = 50  # a terminal narrower shows the chat list only while it has focus (Ctrl+L)
BANNER_ROWS = 16  # a terminal shorter hides the banner
BANNER_COLUMNS = 128  # one narrower shows SHORT_BANNER (the long one would take 4+ rows)
BARS_ROWS = 10  # a terminal shorter hides the header and the footer too
TAKES_NO_TEXT = (MessageView, ConversationList)  # focused, a paste goes to the box instead


class LayoutMixin:
    """StatechatApp's sizing and focus moves. The app has `is_embedded` (the banner shows),
    `chats` and `conv_id` (the chat list's content) and the widgets of `StatechatApp.compose`
    (#main, #banner, the chat list, the box)."""

    def on_resize(self, event: events.Resize) -> None:
        """Fit the parts to the terminal's new size."""
        self._fit(event.size)

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        """The chat list focused: on a narrow terminal it shows, in place of the chat. A part
        focused outside the widget maximized (the palette's Maximize) brings that back: Up
        from a message maximized focused a message not shown, and `e` then a box not shown."""
        maximized = self.screen.maximized
        if maximized is not None and event.widget not in maximized.walk_children(with_self=True):
            self.screen.minimize()
        if isinstance(event.widget, ConversationList):  # (it fills a narrow terminal)
            self._fit(self.size)

    def on_descendant_blur(self, event: events.DescendantBlur) -> None:
        """The chat list left: on a narrow terminal the chat shows again."""
        if isinstance(event.widget, ConversationList):  # (hidden again on a narrow terminal)
            self._fit(self.size)

    def on_paste(self, event: events.Paste) -> None:
        """A paste made while a message or the chat list has focus (Textual gives it to the
        focused widget, and these take no text: it was lost) goes into the box at its cursor,
        the box focused, as after Ctrl+O. A paste into the box bubbles here too: left alone."""
        if self.is_closing or not isinstance(self.focused, TAKES_NO_TEXT):
            return
        event.stop()
        composer = self.query_one(Composer)
        self._focus_composer()
        composer.replace(event.text, *composer.selection, maintain_selection_offset=False)

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
        listing = chats is self.default_screen.focused  # (has_focus lags a focus move)
        chats.display = not narrow or listing
        self.query_one("#main").display = not (narrow and listing)
        banner = self.query_one("#banner", Static)
        banner.display = self.is_embedded and height >= BANNER_ROWS
        banner.update(EMBEDDED_BANNER if width >= BANNER_COLUMNS else SHORT_BANNER)
        for bar in (self.query_one(Header), self.query_one(Footer)):
            bar.display = height >= BARS_ROWS

    def action_focus_next(self) -> None:
        """Tab: focus the next part, in the same order at every width (the chat list, the
        messages, the box)."""
        self._move_focus(super().action_focus_next)

    def action_focus_previous(self) -> None:
        """Shift+Tab: focus the previous part, in the same order at every width."""
        self._move_focus(super().action_focus_previous)

    def _move_focus(self, move) -> None:
        """Run Textual's focus move `move` over every part: a narrow terminal hides the chat
        list or the chat (#main), and Textual skips what is hidden, so Tab from the list, which
        then filled the terminal, found nothing else and the focus stayed there. Then show the
        part now focused (and hide the other) as `_fit` does."""
        self.query_one(ConversationList).display = True
        self.query_one("#main").display = True
        move()
        self._fit(self.size)

    def _focus_composer(self) -> None:
        self.query_one("#main").display = True  # (hidden while the list fills a narrow terminal)
        self.screen.set_focus(self.query_one(Composer))  # (now: the keys typed next go to it)

    def action_focus_list(self) -> None:
        """Ctrl+L: focus the chat list (shown, even on a narrow terminal), read again: another
        statechat on the same cache dir may have started or deleted chats since."""
        chats = self.query_one(ConversationList)
        if self.chats is not None:
            chats.show(self.chats.conversations(), self.conv_id)
        chats.display = True  # (a narrow terminal hides it while it is not focused)
        self.screen.set_focus(chats)  # (now: the keys typed next go to it)

    def action_focus_input(self) -> None:
        """Ctrl+O: focus the message box."""
        self._focus_composer()
