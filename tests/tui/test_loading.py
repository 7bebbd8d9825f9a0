"""Keys pressed on the loading screen (a load takes a minute on a GPU) leave the app working:
Ctrl+N crashed it (the chats were not open yet), and Ctrl+P's command palette, still open as
the load ended, was closed in the loading screen's place, leaving the app on that screen."""

from __future__ import annotations

import asyncio
import threading

import pytest

from statechat.tui import app as app_module
from statechat.tui.widgets.composer import Composer
from tests.tui.test_app import make_app, send, views, wait_ready


@pytest.mark.parametrize("keys", [("ctrl+n",), ("ctrl+l", "ctrl+o", "escape", "tab"),
                                  ("ctrl+p",)])
def test_keys_on_the_loading_screen_leave_the_app_working(loaded, tmp_path, monkeypatch,
                                                          keys):
    opened = threading.Event()
    real_open = app_module.open_chats

    def open_chats(path):  # (the load holds at its last step until the keys are pressed)
        assert opened.wait(30)
        return real_open(path)

    monkeypatch.setattr(app_module, "open_chats", open_chats)

    async def run():
        app = make_app(loaded, tmp_path)
        async with app.run_test(size=(120, 50)) as pilot:
            await pilot.pause(0.1)
            assert app.screen.id == "loading"
            await pilot.press(*keys)
            opened.set()
            await wait_ready(pilot, app)
            await pilot.pause(0.1)
            assert app.screen.id == "_default" and len(app.screen_stack) == 1
            assert app.focused is app.query_one(Composer)
            await send(pilot, app, "hello")
            assert len(views(app)) == 2

    asyncio.run(run())  # (run_test raises what crashed the app)
