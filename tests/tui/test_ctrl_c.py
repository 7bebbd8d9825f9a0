"""Ctrl+C while a reply streams stops it, as Esc does (the key that stops generation in
llama.cpp's and mlx-lm's chats: it only said how to quit, and the reply went on); with no
reply streaming it still says that Ctrl+Q quits, and quits nothing."""

from __future__ import annotations

import asyncio

from tests.tui.test_app import make_app, status, views, wait_idle, wait_ready
from tests.tui.test_edge_cases import long_reply_app, notices, start_long_reply


def test_ctrl_c_stops_a_streaming_reply(loaded, tmp_path):
    async def run():
        app = long_reply_app(loaded, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await start_long_reply(pilot, app)
            assert app.handle is not None
            await pilot.press("ctrl+c")
            await wait_idle(pilot, app)
            assert "stopped" in status(views(app)[1])
            assert app.is_running and not app.is_closing
            assert any("Esc" in n for n in notices(app))  # (it names the app's own key)

    asyncio.run(run())


def test_ctrl_c_with_no_reply_streaming_says_how_to_quit(loaded, tmp_path):
    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_ready(pilot, app)
            await pilot.press("ctrl+c")
            await pilot.pause()
            assert app.is_running and not app.is_closing
            assert any("to quit" in n for n in notices(app))

    asyncio.run(run())
