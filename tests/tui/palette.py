"""Running a command of the app's command palette (Ctrl+P) as a user does: open it, type the
command's first word, wait for the command to be listed first, Enter."""

from __future__ import annotations

import time

from textual.command import CommandList, CommandPalette


async def run_command(pilot, app, name: str, timeout: float = 10) -> None:
    """Ctrl+P, `name`'s first word typed, Enter once `name` is the first command listed."""
    await pilot.press("ctrl+p")
    end = time.monotonic() + timeout
    while not isinstance(app.screen, CommandPalette):
        assert time.monotonic() < end, "the command palette did not open"
        await pilot.pause(0.05)
    await pilot.press(*name.lower().split()[0])  # (its first word is enough)
    listed = app.screen.query_one(CommandList)
    while (listed.highlighted is None
           or name not in str(listed.get_option_at_index(listed.highlighted).prompt)):
        assert time.monotonic() < end, f"{name!r} was not listed first"
        await pilot.pause(0.05)
    await pilot.press("enter")
    await pilot.pause(0.1)
