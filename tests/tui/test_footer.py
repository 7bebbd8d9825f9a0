"""The footer fits a terminal of the usual 80x24: with a message focused it shows every key of
the message whole, y Copy among them, and still the app's Quit key (its labels took 86 columns,
so it showed `d D` and no Ctrl+Q; the keys now stand one space apart), and on the chat list
Backspace, the key a Mac labels Delete, asks to delete the highlighted chat as Delete does."""

from __future__ import annotations

import asyncio

from tests.tui.test_app import make_app, screen_lines, send, views, wait_ready
from tests.tui.test_edge_cases import focus_message, notices


def test_a_focused_message_s_keys_and_quit_fit_80_columns(loaded, tmp_path):
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "hello")
            for index in (0, 1):  # your message, then its reply
                await focus_message(pilot, app, index)
                footer = screen_lines(app)[-1]
                for key in ("e Edit", "r Regenerate", "c Continue", "Branch", "d Delete",
                            "y Copy", "^q Quit"):
                    assert key in footer, footer

    asyncio.run(run())


def test_backspace_on_the_chat_list_asks_then_deletes(loaded, tmp_path):
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot, app)
            await send(pilot, app, "chat a")
            await pilot.press("ctrl+l")
            assert "del Delete chat" in screen_lines(app)[-1]
            await pilot.press("backspace")
            await pilot.pause(0.1)
            assert notices(app)[-1].startswith("Delete chat 'chat a'")
            assert len(app.chats.conversations()) == 1
            await pilot.press("backspace")
            await pilot.pause(0.1)
            assert app.chats.conversations() == [] and views(app) == []

    asyncio.run(run())
