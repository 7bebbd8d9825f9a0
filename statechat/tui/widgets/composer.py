"""Composer: the message box. Enter sends (or submits an edit), Shift+Enter or Ctrl+J starts a
new line, and a paste keeps every line of the pasted text. An edit puts the unsent text aside
and brings it back when it ends."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.strip import Strip
from textual.widgets import TextArea

PLACEHOLDER = "Message (Enter sends, Ctrl+J new line)"
EDIT_PLACEHOLDER = "Edit the message (Enter makes a new branch, Esc cancels)"
# Ctrl+J sends a line feed in every terminal; Shift+Enter is told from Enter only by terminals
# that report modifiers (the kitty keyboard protocol), so both start a new line.
NEWLINE_KEYS = frozenset({"ctrl+j", "shift+enter"})


class Composer(TextArea):
    """A multi-line box that knows whether it is editing an earlier message (`editing` holds its
    id). Enter posts `Composer.Submitted` with the text instead of breaking the line."""

    class Submitted(Message):
        """Enter was pressed: `text` is the box's text at that moment."""

        def __init__(self, composer: Composer, text: str) -> None:
            super().__init__()
            self.composer, self.text = composer, text

        @property
        def control(self) -> Composer:
            """The box it came from (Textual's `on` selectors match on it)."""
            return self.composer

    def __init__(self) -> None:
        super().__init__(placeholder=PLACEHOLDER, id="composer", soft_wrap=True,
                         highlight_cursor_line=False)
        self.editing: str | None = None
        self.original = ""  # the edited message's text as it was
        self.draft = ""  # unsent text an edit put aside (until it ends, or its kept text is sent)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in NEWLINE_KEYS and not self.read_only:
            event.stop()
            event.prevent_default()
            self.replace("\n", *self.selection, maintain_selection_offset=False)
        else:
            await super()._on_key(event)

    def render_line(self, y: int) -> Strip:
        """One row of the box; blank while it has no column for text (Textual wraps the
        placeholder to that width, and wrapping to 0 columns raises): a terminal a few columns
        wide, or the frame between a resize and `LayoutMixin._fit`, which fits the chat list
        to the new width while the screen is still laid out at the old one."""
        if self.content_size.width < 1:
            return Strip.blank(0)
        return super().render_line(y)

    def set_text(self, text: str) -> None:
        """Replace the whole text, the cursor at its end."""
        self.load_text(text)
        self.move_cursor(self.document.end)

    def take(self, sent: str) -> None:
        """Remove the text just sent (an edit's too, which ends the edit and brings back the
        text it put aside): keys typed after Enter, queued before it was handled, stay in the
        box, and a draft that a kept edit left aside comes back."""
        rest = self.text[len(sent):] if self.text.startswith(sent) else ""
        if self.editing is not None:
            self.end_edit()
            self.set_text(self.text + rest)
            return
        if self.draft and not rest.strip():
            rest, self.draft = self.draft, ""
        self.set_text(rest)

    @property
    def changed(self) -> bool:
        """Whether an edit's text differs from its message."""
        return self.editing is not None and self.text != self.original

    def start_edit(self, msg_id: str, text: str) -> None:
        """Show `text` to edit; what was typed and not sent waits until the edit ends."""
        if self.editing is None:  # (a draft a kept edit left aside stays, after this text)
            self.draft = "\n\n".join(t for t in (self.text, self.draft) if t.strip())
        self.editing, self.original = msg_id, text
        self.set_text(text)
        self.placeholder = EDIT_PLACEHOLDER
        self.border_title = "editing: Enter makes a new branch, Esc cancels"
        self.add_class("editing")
        self.screen.set_focus(self)  # (now, not after the keys already queued: they edit)

    def end_edit(self, keep: bool = False) -> None:
        """Leave an edit (sent, cancelled, or its message gone): the text put aside comes back,
        or with `keep` the edited text stays, to be sent as a new message, and the text put
        aside comes back once it is sent (`take`)."""
        if self.editing is None:
            return
        self.editing = None
        if not keep:
            self.set_text(self.draft)
            self.draft = ""
        self.placeholder = PLACEHOLDER
        self.border_title = None
        self.remove_class("editing")
